"""AWQ (AutoAWQ's GEMM layout, as transformers reads it): config.json ``quant_method: awq``.

- ``config``: ``bits``, ``group_size``, ``zero_point``, ``version``, ``modules_to_not_convert``,
  read into ``AwqConfig``;
- ``detect``: each quantized module matched against the schemes' ``detect.awq`` rules (the
  flat-config detection shared with GPTQ, ``producers.gptq.keyed``);
- ``rule``: the ``detect.awq`` rule;
- ``write_config``: qscheme converts AWQ checkpoints but writes none.

The layout (``qweight`` int32 [K, N/8] packed along N in the order 0, 2, 4, 6, 1, 3, 5, 7,
``qzeros`` [K/g, N/8] likewise, ``scales`` [K/g, N]) is declared in schemes/awq/*.yaml.
"""

from __future__ import annotations

from qscheme.producers.awq import config, detect, rule, write_config
from qscheme.producers.awq.config import AwqConfig
from qscheme.producers.base import Producer
from qscheme.producers.gptq import keyed

PRODUCER = Producer(
    name="awq",
    quant_method="awq",
    config_type=AwqConfig,
    read_section=config.read_section,
    detect=detect.detect,
    writes=write_config.writes,
    write_config=write_config.write_config,
    label="AWQ",
    listed_as="'awq'",
    overlap=keyed.overlap_witness(rule.NAME),
    overlap_fix=keyed.OVERLAP_FIX,
    rule_schema=rule.RULE_SCHEMA,
    transformers_owns_method=True,
)

__all__ = ["PRODUCER", "AwqConfig"]
