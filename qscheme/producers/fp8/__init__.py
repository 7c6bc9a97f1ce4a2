"""DeepSeek-style FP8 blocks: config.json ``quant_method: fp8`` (DeepSeek-V3/R1, V3.1's UE8M0
scales, and transformers' ``FineGrainedFP8Config``).

Per quantized Linear: ``weight`` float8_e4m3fn [N, K] and ``weight_scale_inv`` float32
[ceil(N/R), ceil(K/C)] for blocks of R x C (``weight_block_size``, 128x128 in every known
checkpoint); despite its name the scale is a MULTIPLIER: w = float32(code) * scale per block.

- ``config``: the ``quantization_config`` read into ``Fp8Config`` (what is refused, and why);
- ``detect``: the scheme whose ``detect.fp8`` rule and weight block fit the config, given to every
  module that stores quantized tensors; ``modules_to_not_convert`` matched as transformers does;
- ``rule``: its ``detect.fp8`` rule in a scheme descriptor, handed to the descriptor's parser;
- ``write_config``: the ``quantization_config`` DeepSeek ships, for ``qscheme convert``;
- ``overlap``: rules of two schemes that claim the same config (for ``qscheme validate``).

transformers owns the method name ``fp8`` (its FineGrainedFP8 quantizer); qscheme's route is the
opt-in ``qscheme-fp8`` (``qscheme.transformers.via_qscheme``).
"""

from __future__ import annotations

from qscheme.producers.base import Producer
from qscheme.producers.fp8 import config, detect, overlap, rule, write_config
from qscheme.producers.fp8.config import Fp8Config

PRODUCER = Producer(
    name="fp8",
    quant_method="fp8",
    config_type=Fp8Config,
    read_section=config.read_section,
    detect=detect.detect,
    writes=write_config.writes,
    write_config=write_config.write_config,
    label="FP8-block (DeepSeek)",
    listed_as="'fp8' (DeepSeek FP8 blocks)",
    overlap=overlap.witness,
    overlap_fix=overlap.FIX,
    rule_schema=rule.RULE_SCHEMA,
    transformers_owns_method=True,
)

__all__ = ["PRODUCER", "Fp8Config"]
