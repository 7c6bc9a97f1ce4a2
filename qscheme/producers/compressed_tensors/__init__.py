"""compressed-tensors (and llm-compressor): config.json ``quant_method: compressed-tensors``.

- ``config``: the ``quantization_config`` read into ``CompressedTensorsConfig``;
- ``detect``: config groups matched against the schemes' ``detect.compressed-tensors`` rules;
- ``rule``: its ``detect.compressed-tensors`` rule in a scheme descriptor (keys, typed rule, how
  ``qscheme show`` prints it), handed to the descriptor's parser;
- ``write_config``: the ``quantization_config`` compressed-tensors 0.20 writes for a scheme;
- ``overlap``: rules of two schemes that claim the same config (for ``qscheme validate``);
- ``arithmetic``: compressed-tensors' quantization arithmetic (the ``compressed-tensors`` rules).
"""

from __future__ import annotations

from qscheme.producers.base import Producer
from qscheme.producers.compressed_tensors import config, detect, overlap, rule, write_config
from qscheme.producers.compressed_tensors.config import CompressedTensorsConfig

PRODUCER = Producer(
    name="compressed-tensors",
    quant_method="compressed-tensors",
    config_type=CompressedTensorsConfig,
    read_section=config.read_section,
    detect=detect.detect,
    writes=write_config.writes,
    write_config=write_config.write_config,
    label="compressed-tensors",
    listed_as="'compressed-tensors'",
    arithmetic="qscheme.producers.compressed_tensors.arithmetic",
    overlap=overlap.witness,
    overlap_fix=overlap.FIX,
    rule_schema=rule.RULE_SCHEMA,
    transformers_owns_method=True,
)

__all__ = ["PRODUCER", "CompressedTensorsConfig"]
