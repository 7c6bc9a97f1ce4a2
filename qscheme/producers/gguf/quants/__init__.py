"""llama.cpp's reference GGUF quantizers, bit for bit, in torch.

``quantize_blocks(weights, "Q4_K")`` returns the bytes that llama.cpp's ``llama-quantize`` writes
for a float32 weight when it has no importance matrix (ggml-quants.c's ``quantize_<type>`` with no
weights: ``quantize_row_<type>_ref`` for most types, IQ4_NL's and IQ4_XS's own search with
``ntry = 7``), row by row. ``supported_types()`` lists the types it reproduces: the legacy
32-weight types (legacy), the k-quants (kquants), IQ4_NL and IQ4_XS (nonlinear), MXFP4 and NVFP4
(fp4).
"""

from __future__ import annotations

from qscheme.producers.gguf.quants.api import quantize_blocks, supported_types

__all__ = ["quantize_blocks", "supported_types"]
