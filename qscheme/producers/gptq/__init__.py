"""GPTQ (GPTQModel, AutoGPTQ, optimum, AutoRound's ``auto_gptq`` export): config.json
``quant_method: gptq``.

- ``config``: ``bits``, ``group_size``, ``sym``, ``desc_act``, ``checkpoint_format`` and the
  per-module ``dynamic`` overrides, read into ``GptqConfig``;
- ``detect``: each quantized module's values matched against the schemes' ``detect.gptq`` rules;
- ``rule``: the ``detect.gptq`` rule (``checkpoint_format`` and config values), built on ``keyed``,
  the flat-config detection GPTQ and AWQ share;
- ``write_config``: qscheme converts GPTQ checkpoints but writes none.

The layout (``qweight`` int32 [K/8, N] packed along K, ``qzeros`` [K/g, N/8] packed along N,
``scales`` [K/g, N], ``g_idx`` [K]) is declared in schemes/gptq/*.yaml, nowhere in code.
"""

from __future__ import annotations

from qscheme.producers.base import Producer
from qscheme.producers.gptq import config, detect, keyed, rule, write_config
from qscheme.producers.gptq.config import GptqConfig

PRODUCER = Producer(
    name="gptq",
    quant_method="gptq",
    config_type=GptqConfig,
    read_section=config.read_section,
    detect=detect.detect,
    writes=write_config.writes,
    write_config=write_config.write_config,
    label="GPTQ",
    listed_as="'gptq'",
    arithmetic="qscheme.producers.gptq.arithmetic",
    overlap=keyed.overlap_witness(rule.NAME),
    overlap_fix=keyed.OVERLAP_FIX,
    rule_schema=rule.RULE_SCHEMA,
    transformers_owns_method=True,
)

__all__ = ["PRODUCER", "GptqConfig"]
