"""AutoRound (Intel's auto-round): config.json ``quant_method: auto-round``.

- ``config``: ``bits``, ``group_size``, ``sym``, ``data_type``, ``act_bits``, ``packing_format``,
  ``block_name_to_quantize`` and the per-layer ``extra_config``, read into ``AutoRoundConfig``;
- ``packing``: the layout each ``packing_format`` names (GPTQ v1, GPTQ v2 or AutoAWQ GEMM);
- ``detect``: each quantized module matched against the GPTQ or AWQ schemes' rules of its layout;
- ``write_config``: qscheme reads AutoRound checkpoints but writes none.

AutoRound's ``auto_gptq`` and ``auto_awq`` exports that say ``quant_method: gptq`` / ``awq`` are
read by those producers. The layouts are declared in schemes/gptq*/ and schemes/awq/, nowhere here.
"""

from __future__ import annotations

from qscheme.producers.auto_round import config, detect, packing, write_config
from qscheme.producers.auto_round.config import AutoRoundConfig
from qscheme.producers.base import Producer

PRODUCER = Producer(
    name="auto_round",
    quant_method="auto-round",
    config_type=AutoRoundConfig,
    read_section=config.read_section,
    detect=detect.detect,
    writes=write_config.writes,
    write_config=write_config.write_config,
    label="AutoRound",
    listed_as="'auto-round'",
    transformers_owns_method=True,
)

__all__ = ["PRODUCER", "AutoRoundConfig", "packing"]
