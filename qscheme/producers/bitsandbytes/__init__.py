"""bitsandbytes 4-bit checkpoints (config.json ``quant_method: bitsandbytes``, ``load_in_4bit``), as
transformers' ``save_pretrained`` writes them: NF4 or FP4 codes, with or without double
quantization of the block scales.

- ``config``: config.json's ``quantization_config`` read into ``BitsAndBytesConfig`` (LLM.int8
  refused);
- ``quant_state``: each layer's serialized state (a uint8 tensor of JSON), parsed strictly;
- ``layout``: a layer's tensors checked against its state and the config, from the headers;
- ``dequantize``: the exact float32 dequantization bitsandbytes computes (torch; imported on use);
- ``read``: a folder read layer by layer (``read_layers``), each layer dequantized on demand (the
  producer's own exact reading, kept as a second reader the loader is tested against);
- ``rule`` / ``detect``: the ``detect.bitsandbytes`` rule and each module's scheme from the config;
- ``write_config``: qscheme reads these checkpoints and writes no bitsandbytes config;
- ``arithmetic``: the layer quantizer ``quantize_weight`` uses for these schemes.

The stored form (flat codes, high nibble first, a codebook, absmax per block of 64, double
quantization, the JSON quant state) is declared in schemes/bitsandbytes/*.yaml, nowhere in the
loader's code.
"""

from __future__ import annotations

from qscheme.producers.base import Producer
from qscheme.producers.bitsandbytes import config, detect, rule, write_config
from qscheme.producers.bitsandbytes.config import QUANT_METHOD, BitsAndBytesConfig
from qscheme.producers.gptq import keyed

PRODUCER = Producer(
    name="bitsandbytes",
    quant_method=QUANT_METHOD,
    config_type=BitsAndBytesConfig,
    read_section=config.read_section,
    detect=detect.detect,
    writes=write_config.writes,
    write_config=write_config.write_config,
    label="bitsandbytes 4-bit",
    listed_as="'bitsandbytes' (4-bit)",
    arithmetic="qscheme.producers.bitsandbytes.arithmetic",
    overlap=keyed.overlap_witness(rule.NAME),
    overlap_fix=keyed.OVERLAP_FIX,
    rule_schema=rule.RULE_SCHEMA,
    transformers_owns_method=True,
)

__all__ = ["PRODUCER", "QUANT_METHOD", "BitsAndBytesConfig"]
