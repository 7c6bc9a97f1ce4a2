"""The ``fp8`` producer's config, typed: config.json ``quantization_config`` with ``quant_method:
fp8``, as DeepSeek-V3/R1 ship it (``fmt``, ``activation_scheme``, ``weight_block_size``) and as
transformers' ``FineGrainedFP8Config`` writes it (the same keys, plus ``modules_to_not_convert``,
``scale_fmt`` and others).

What qscheme reads, and what it refuses (each a CheckpointError naming the key and the value):

- ``fmt``: ``e4m3`` (torch.float8_e4m3fn), the default when absent; anything else is refused;
- ``weight_block_size``: two positive sizes ``[rows, columns]``; absent means ``[128, 128]``
  (transformers' default). ``null`` (one scale per tensor) is refused: not a block format;
- ``scale_fmt``: ``float`` (the default: float32 scales) or ``ue8m0`` (power-of-two scales,
  DeepSeek-V3.1 and later);
- ``activation_scheme``: ``dynamic`` (case-insensitive, as transformers reads it); ``static``
  is refused (no fp8 scheme declares its static activation scale's tensor);
- ``modules_to_not_convert`` (or MiniMax's alias ``ignored_layers``): modules left unquantized;
- ``modules_to_convert`` (FP8 embedding tables) and ``expert_dtype: fp4`` (DeepSeek-V4's FP4
  experts) are refused: they are not FP8-block linear layers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from qscheme.errors import CheckpointError
from qscheme.producers.base import ConfigFields

DEFAULT_BLOCK = (128, 128)


@dataclass(frozen=True)
class Fp8Config:
    """config.json's ``quantization_config`` with ``quant_method: fp8`` (DeepSeek-style FP8 blocks)."""

    file: str
    weight_block_size: tuple[int, int]
    scale_fmt: str
    activation_scheme: str
    modules_to_not_convert: tuple[str, ...]
    fmt: str = "e4m3"
    producer: str = "fp8"
    producer_version: str | None = None
    producer_note: str | None = None
    has_kv_cache: bool = False


def _fail(fields: ConfigFields, key: str, value: Any, why: str) -> CheckpointError:
    return CheckpointError(f"{fields.file}: quantization_config.{key} is {json.dumps(value)[:80]}; {why}")


def _block_size(fields: ConfigFields) -> tuple[int, int]:
    if "weight_block_size" not in fields.items:
        return DEFAULT_BLOCK
    value = fields.items["weight_block_size"]
    if value is None:
        raise _fail(
            fields,
            "weight_block_size",
            value,
            "one FP8 scale per tensor is not a block format, and no fp8 scheme declares it: re-export with "
            "blocks (weight_block_size [128, 128]), or as compressed-tensors FP8",
        )
    sizes = value if isinstance(value, list) else None
    if (
        sizes is None
        or len(sizes) != 2
        or not all(isinstance(size, int) and not isinstance(size, bool) and size >= 1 for size in sizes)
    ):
        raise _fail(
            fields, "weight_block_size", value, "expected two positive sizes [rows, columns] such as [128, 128]"
        )
    return int(sizes[0]), int(sizes[1])


def read_section(fields: ConfigFields) -> Fp8Config:
    fmt = fields.string("fmt") or "e4m3"
    if fmt != "e4m3":
        raise _fail(
            fields, "fmt", fmt, "qscheme reads FP8-block weights in e4m3 (torch.float8_e4m3fn), as DeepSeek ships them"
        )
    scale_fmt = fields.string("scale_fmt") or "float"
    if scale_fmt not in ("float", "ue8m0"):
        raise _fail(fields, "scale_fmt", scale_fmt, "expected 'float' (float32 scales) or 'ue8m0' (powers of two)")
    activation = (fields.string("activation_scheme") or "dynamic").lower()
    if activation == "static":
        raise _fail(
            fields,
            "activation_scheme",
            activation,
            "static FP8-block activation scales are not supported (producers name their tensor differently: "
            "input_scale or activation_scale, and no fp8 scheme declares one); qscheme reads activation_scheme "
            "'dynamic' (per token and group of 128, computed at run time)",
        )
    if activation != "dynamic":
        raise _fail(fields, "activation_scheme", activation, "expected 'dynamic'")
    if fields.strings("modules_to_convert"):
        raise _fail(
            fields,
            "modules_to_convert",
            list(fields.strings("modules_to_convert")),
            "FP8 embedding tables are not linear layers qscheme loads; re-export with the embeddings in 16 bits",
        )
    expert_dtype = fields.string("expert_dtype")
    if expert_dtype not in (None, "fp8"):
        raise _fail(
            fields,
            "expert_dtype",
            expert_dtype,
            "only FP8 experts are FP8-block weights (DeepSeek-V4's FP4-packed experts are not supported)",
        )
    skipped = fields.strings("modules_to_not_convert") or fields.strings("ignored_layers")
    return Fp8Config(
        file=fields.file,
        weight_block_size=_block_size(fields),
        scale_fmt=scale_fmt,
        activation_scheme=activation,
        modules_to_not_convert=skipped,
        fmt=fmt,
    )
