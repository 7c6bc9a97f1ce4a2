"""llama.cpp's reference GGUF quantizers, bit for bit, in torch.

``quantize_blocks(weights, "Q4_K")`` returns the bytes that llama.cpp's ``llama-quantize`` writes
for a float32 weight when it has no importance matrix (ggml-quants.c's ``quantize_<type>`` with no
weights, i.e. ``quantize_row_<type>_ref`` for most types), row by row. ``supported_types()`` lists
the types it reproduces.
"""

from __future__ import annotations

from qscheme.producers.gguf.quants.api import quantize_blocks, supported_types

__all__ = ["quantize_blocks", "supported_types"]
