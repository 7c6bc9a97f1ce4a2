"""NVIDIA ModelOpt: hf_quant_config.json, or config.json ``quant_method: modelopt``.

- ``config``: hf_quant_config.json's ``quantization`` (or config.json's section) read into
  ``ModeloptConfig``;
- ``detect``: ``quant_algo`` (per layer for mixed precision) matched against the schemes'
  ``detect.modelopt`` rules;
- ``rule``: its ``detect.modelopt`` rule in a scheme descriptor (keys, typed rule, how
  ``qscheme show`` prints it), handed to the descriptor's parser;
- ``write_config``: hf_quant_config.json and the ``quantization_config`` ModelOpt 0.47 writes;
- ``overlap``: rules of two schemes that claim the same config (for ``qscheme validate``);
- ``arithmetic``: ModelOpt's export arithmetic (the ``modelopt`` rules).
"""

from __future__ import annotations

from qscheme.producers.base import Producer
from qscheme.producers.modelopt import config, detect, overlap, rule, write_config
from qscheme.producers.modelopt.config import MODELOPT_FILE, ModeloptConfig

PRODUCER = Producer(
    name="modelopt",
    quant_method="modelopt",
    config_type=ModeloptConfig,
    read_section=config.read_section,
    detect=detect.detect,
    writes=write_config.writes,
    write_config=write_config.write_config,
    label="ModelOpt",
    listed_as="'modelopt'",
    own_file=MODELOPT_FILE,
    read_own_file=config.read_own_file,
    arithmetic="qscheme.producers.modelopt.arithmetic",
    overlap=overlap.witness,
    overlap_fix=overlap.FIX,
    rule_schema=rule.RULE_SCHEMA,
)

__all__ = ["MODELOPT_FILE", "PRODUCER", "ModeloptConfig"]
