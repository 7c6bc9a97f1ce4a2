"""bitsandbytes 4-bit checkpoints (config.json ``quant_method: bitsandbytes``, ``load_in_4bit``), as
transformers' ``save_pretrained`` writes them: NF4 or FP4 codes, with or without double
quantization of the block scales.

- ``config``: config.json's ``quantization_config`` read into ``BitsAndBytesConfig`` (LLM.int8
  refused);
- ``quant_state``: each layer's serialized state (a uint8 tensor of JSON), parsed strictly;
- ``layout``: a layer's tensors checked against its state and the config, from the headers;
- ``dequantize``: the exact float32 dequantization bitsandbytes computes (torch; imported on use);
- ``read``: a folder read layer by layer (``read_layers``), each layer dequantized on demand.

Not yet a ``Producer`` in ``qscheme.producers.PRODUCERS``: the descriptor language has no scheme
for these layers' stored form yet (a flat code stream whose codes index a table, with scales
stored apart and themselves quantized), so ``load_checkpoint`` does not read these folders.
"""

from __future__ import annotations

from qscheme.producers.bitsandbytes.config import QUANT_METHOD, BitsAndBytesConfig

__all__ = ["QUANT_METHOD", "BitsAndBytesConfig"]
