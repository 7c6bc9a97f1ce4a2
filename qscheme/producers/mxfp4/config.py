"""gpt-oss's MXFP4 config, typed: config.json's ``quantization_config`` with ``quant_method: mxfp4``.

OpenAI's release writes ``{"quant_method": "mxfp4", "modules_to_not_convert": [...]}``; the list
names, as shell wildcards, the modules left in bf16 (``model.layers.*.self_attn``, the routers,
the embeddings, ``lm_head``): only the MoE experts are quantized.
"""

from __future__ import annotations

from dataclasses import dataclass

from qscheme.producers.base import ConfigFields

QUANT_METHOD = "mxfp4"


@dataclass(frozen=True)
class Mxfp4Config:
    """gpt-oss's quantization section of config.json."""

    file: str
    quant_method: str
    modules_to_not_convert: tuple[str, ...]
    producer: str = "mxfp4"
    producer_version: str | None = None
    producer_note: str | None = None
    has_kv_cache: bool = False


def read_section(fields: ConfigFields) -> Mxfp4Config:
    """config.json's ``quantization_config`` (``quant_method: mxfp4``)."""
    method = fields.string("quant_method", required=True)
    assert method is not None  # required=True raised otherwise
    return Mxfp4Config(
        file=fields.file, quant_method=method, modules_to_not_convert=fields.strings("modules_to_not_convert")
    )
