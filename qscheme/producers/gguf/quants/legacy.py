"""ggml's first quantizations, 32 weights a block: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0.

Each mirrors ``quantize_row_<type>_ref`` of ggml-quants.c, which is also what ``quantize_<type>``
runs without an importance matrix. One round-to-nearest pass, no search: the scale comes from the
block's extreme value, so no sum's order matters. Every function takes the blocks element-major,
float32 ``[32, blocks]``, and returns the block bytes, uint8 ``[blocks, block_bytes]``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qscheme.producers.gguf.quants.c_float import (
    divide,
    first_of_extreme,
    first_of_largest_magnitude,
    fp16_bytes,
    round_half_away,
    truncate_to_int,
    wrap_int8,
    wrap_uint8,
)
from qscheme.producers.gguf.quants.packing import pack_bit_planes, pack_nibble_halves


def _reciprocal_or_zero(scale: Tensor) -> Tensor:
    """C's ``d ? 1.0f/d : 0.0f``."""
    return torch.where(scale != 0, divide(1.0, scale), torch.zeros_like(scale))


def _symmetric_codes(blocks: Tensor, levels: int) -> tuple[Tensor, Tensor]:
    """Q4_0 / Q5_0: d = max / -levels from the first value of largest magnitude (it gets code 0);
    codes ``MIN(2 levels - 1, (int8_t)(x / d + levels + 0.5))``. Returns (d, codes int32)."""
    _, signed_max = first_of_largest_magnitude(blocks)
    scale = divide(signed_max, float(-levels))
    shifted = blocks * _reciprocal_or_zero(scale) + (levels + 0.5)
    codes = wrap_uint8(torch.clamp_max(wrap_int8(truncate_to_int(shifted)), 2 * levels - 1))
    return scale, codes


def _offset_scale(blocks: Tensor, top_code: int) -> tuple[Tensor, Tensor, Tensor]:
    """Q4_1 / Q5_1: d = (max - min) / top_code, offset min; codes of (x - min) / d + 0.5 truncated.
    Returns (d, min, codes before the cast to an integer)."""
    low = first_of_extreme(blocks, largest=False)
    high = first_of_extreme(blocks, largest=True)
    scale = divide(high - low, float(top_code))
    return scale, low, (blocks - low) * _reciprocal_or_zero(scale) + 0.5


def _high_bits(codes: Tensor) -> Tensor:
    """The 5th bit of every code, as Q5_0's and Q5_1's 32-bit ``qh`` (bit e for element e)."""
    return pack_bit_planes((codes >> 4) & 1)


def quantize_q4_0(blocks: Tensor) -> Tensor:
    """Q4_0: fp16 d, then 16 bytes of 4-bit codes (element j low nibble, j + 16 high)."""
    scale, codes = _symmetric_codes(blocks, 8)
    return torch.cat([fp16_bytes(scale), pack_nibble_halves(codes)], dim=1)


def quantize_q5_0(blocks: Tensor) -> Tensor:
    """Q5_0: fp16 d, 4 bytes of 5th bits, 16 bytes of low nibbles."""
    scale, codes = _symmetric_codes(blocks, 16)
    return torch.cat([fp16_bytes(scale), _high_bits(codes), pack_nibble_halves(codes)], dim=1)


def quantize_q4_1(blocks: Tensor) -> Tensor:
    """Q4_1: fp16 d, fp16 min, 16 bytes of 4-bit codes."""
    scale, low, shifted = _offset_scale(blocks, 15)
    codes = wrap_uint8(torch.clamp_max(wrap_int8(truncate_to_int(shifted)), 15))
    return torch.cat([fp16_bytes(scale), fp16_bytes(low), pack_nibble_halves(codes)], dim=1)


def quantize_q5_1(blocks: Tensor) -> Tensor:
    """Q5_1: fp16 d, fp16 min, 4 bytes of 5th bits, 16 bytes of low nibbles (no clamp in C)."""
    scale, low, shifted = _offset_scale(blocks, 31)
    codes = wrap_uint8(truncate_to_int(shifted))
    return torch.cat([fp16_bytes(scale), fp16_bytes(low), _high_bits(codes), pack_nibble_halves(codes)], dim=1)


def quantize_q8_0(blocks: Tensor) -> Tensor:
    """Q8_0: fp16 d = max|x| / 127, then 32 int8 codes ``roundf(x / d)``."""
    scale = divide(blocks.abs().amax(dim=0), 127.0)
    codes = round_half_away(blocks * _reciprocal_or_zero(scale)).to(torch.int32)
    return torch.cat([fp16_bytes(scale), wrap_uint8(codes).to(torch.uint8).T], dim=1)
