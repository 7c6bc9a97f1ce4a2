"""gpt-oss MXFP4 (config.json ``quant_method: mxfp4``): OpenAI's release format for MoE experts.

- ``config``: config.json's ``quantization_config`` read into ``Mxfp4Config``;
- ``detect``: the per-expert modules (split from the stacked experts tensors, ``STACKED_EXPERTS``)
  matched against the schemes' ``detect.mxfp4`` rules; everything else stays bf16;
- ``rule``: its ``detect.mxfp4`` rule in a scheme descriptor, handed to the descriptor's parser.

qscheme reads these checkpoints; it does not write them (``writes`` is false: ``qscheme convert``
turns them into compressed-tensors MXFP4A16, whose codes are the same, one layer per expert and
projection: ``writing.convert_experts``).
"""

from __future__ import annotations

from typing import Any

from qscheme.descriptor import Scheme
from qscheme.producers.base import Producer, WriteRequest
from qscheme.producers.mxfp4 import config, detect, rule
from qscheme.producers.mxfp4.config import QUANT_METHOD, Mxfp4Config


def _writes(scheme: Scheme) -> bool:
    return False


def _write_config(request: WriteRequest) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    raise NotImplementedError("qscheme does not write gpt-oss MXFP4 checkpoints")  # _writes is always false


PRODUCER = Producer(
    name="mxfp4",
    quant_method=QUANT_METHOD,
    config_type=Mxfp4Config,
    read_section=config.read_section,
    detect=detect.detect,
    writes=_writes,
    write_config=_write_config,
    label="gpt-oss MXFP4",
    listed_as="'mxfp4'",
    rule_schema=rule.RULE_SCHEMA,
    stacked_experts=detect.STACKED_EXPERTS,
    transformers_owns_method=True,
)

__all__ = ["PRODUCER", "QUANT_METHOD", "Mxfp4Config"]
