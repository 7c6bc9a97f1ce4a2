"""ggml's 4-bit non-linear quants: IQ4_NL (32 weights a block) and IQ4_XS (256 a super-block).

Both mirror ``quantize_row_iq4_nl_impl`` of ggml-quants.c as ``quantize_iq4_nl`` and
``quantize_iq4_xs`` run it without an importance matrix (``ntry = 7``; llama-quantize and
``ggml_quantize_chunk`` call these, not the ``_ref`` rows, which use ``ntry = -1``): each weight is
one of 16 fixed levels (``IQ4_NL_LEVELS``) times a block scale found by a weighted (x²)
least-squares search over 16 trial scales. IQ4_XS then stores each 32-weight sub-block's scale as
a six-bit multiple of one fp16 super-block scale. Functions take blocks element-major, float32
``[block_elements, blocks]``, and return uint8 ``[blocks, block_bytes]``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qscheme.producers.gguf.quants.c_float import (
    divide,
    first_of_largest_magnitude,
    fp16_bytes,
    nearest_int,
    sequential_sum,
    uint16_bytes,
)
from qscheme.producers.gguf.quants.kquant_search import GROUP_MAX_EPS
from qscheme.producers.gguf.quants.packing import pack_nibble_halves, pack_pairs_of_halves

# ggml's kvalues_iq4nl: the 16 levels a 4-bit code stands for, ascending.
IQ4_NL_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# Trial inverse scales (itry + levels[0]) / max for itry = -TRIES..TRIES (quantize_iq4_nl/_xs: 7).
TRIES = 7
SUB_BLOCK = 32
SUPER_BLOCK = 256


def nearest_level_index(scaled: Tensor) -> Tensor:
    """ggml's ``best_index_int8(16, kvalues_iq4nl, x)`` (int64): the code of the level nearest x.

    Below the first level 0, above the last 15; between two levels the lower one wins only when
    strictly nearer, distances computed in float32 as C does (``x - val[mu-1] < val[mu] - x``).
    A NaN falls through C's comparisons to 15.
    """
    levels = torch.tensor(IQ4_NL_LEVELS, dtype=torch.float32, device=scaled.device)
    upper = torch.bucketize(scaled, levels, right=True).clamp_(1, len(IQ4_NL_LEVELS) - 1)
    lower = upper - 1
    lower_is_nearer = (scaled - levels[lower]) < (levels[upper] - scaled)
    index = torch.where(lower_is_nearer, lower, upper)
    index = torch.where(scaled <= levels[0], 0, index)
    return torch.where((scaled >= levels[-1]) | torch.isnan(scaled), len(IQ4_NL_LEVELS) - 1, index)


def _fit(x: Tensor, squared: Tensor, inverse: Tensor) -> tuple[Tensor, Tensor]:
    """C's ``sumqx += w*q*x; sumq2 += w*q*q`` with ``q = values[best_index(inverse * x)]``."""
    levels = torch.tensor(IQ4_NL_LEVELS, dtype=torch.float32, device=x.device)
    chosen = levels[nearest_level_index(inverse * x)]
    weighted = squared * chosen
    sums = sequential_sum(torch.stack([weighted * x, weighted * chosen], dim=1))
    return sums[0], sums[1]


def search_block_scales(x: Tensor) -> Tensor:
    """The block scale of each column of ``x`` ``[32, lanes]``: C's first loop over sub-blocks.

    Starts from ``d = max / 127`` (max: the first weight of largest magnitude), fits the
    least-squares scale ``sumqx / sumq2`` for its codes, then keeps each trial inverse scale
    ``(itry - 127) / max`` whose fit ``sumqx² / sumq2`` is strictly better. A column whose largest
    magnitude is below GROUP_MAX_EPS gets scale 0.
    """
    amax, signed_max = first_of_largest_magnitude(x)
    squared = x * x
    first_scale = divide(-signed_max, float(IQ4_NL_LEVELS[0]))  # C's -max / values[0]
    sum_qx, sum_q2 = _fit(x, squared, divide(1.0, first_scale))
    zero = torch.zeros_like(sum_q2)
    scale = torch.where(sum_q2 > 0, sum_qx / sum_q2, zero)
    best = scale * sum_qx
    for trial in range(-TRIES, TRIES + 1):
        sum_qx, sum_q2 = _fit(x, squared, divide(float(trial + IQ4_NL_LEVELS[0]), signed_max))
        better = (sum_q2 > 0) & (sum_qx * sum_qx > best * sum_q2)
        scale = torch.where(better, sum_qx / sum_q2, scale)
        best = torch.where(better, scale * sum_qx, best)
    return torch.where(amax < GROUP_MAX_EPS, zero, scale)


def _reciprocal_or_zero(value: Tensor) -> Tensor:
    """C's ``d ? 1/d : 0``."""
    return torch.where(value != 0, divide(1.0, value), torch.zeros_like(value))


def quantize_iq4_nl(blocks: Tensor) -> Tensor:
    """IQ4_NL: fp16 d, then 16 bytes of 4-bit level codes (element j low nibble, j + 16 high)."""
    scale = search_block_scales(blocks)
    codes = nearest_level_index(_reciprocal_or_zero(scale) * blocks).to(torch.int32)
    return torch.cat([fp16_bytes(scale), pack_nibble_halves(codes)], dim=1)


def quantize_iq4_xs(blocks: Tensor) -> Tensor:
    """IQ4_XS: fp16 d, 16 bits of scale high bits (2 per sub-block), 4 bytes of scale low nibbles
    (sub-block 2k low, 2k + 1 high), 128 bytes of 4-bit codes (byte l of each 32: l and l + 16).

    Sub-block scales become ``l = nearest_int(scale / d)`` in -32..31 with ``d = -max_scale / 32``
    (max_scale: the first scale of largest magnitude, kept in float32, not rounded to fp16), and
    every weight is re-coded against ``d * l``.
    """
    count = SUPER_BLOCK // SUB_BLOCK
    grouped = blocks.reshape(count, SUB_BLOCK, -1)
    sub_blocks = grouped.permute(1, 0, 2).reshape(SUB_BLOCK, -1)  # columns ordered (sub-block, block)
    scales = search_block_scales(sub_blocks).reshape(count, -1)
    _, max_scale = first_of_largest_magnitude(scales)
    d = divide(-max_scale, 32.0)
    steps = torch.clamp(nearest_int(_reciprocal_or_zero(d) * scales), -32, 31)
    sub_scale = d * steps.to(torch.float32)
    codes = nearest_level_index(_reciprocal_or_zero(sub_scale).unsqueeze(1) * grouped).to(torch.int32)

    stored = steps + 32
    low_nibbles = (stored[0::2] & 0xF) | ((stored[1::2] & 0xF) << 4)
    high_bits = torch.zeros_like(stored[0])
    for index in range(count):
        high_bits |= (stored[index] >> 4) << (2 * index)
    return torch.cat(
        [
            fp16_bytes(d),
            uint16_bytes(high_bits),
            low_nibbles.to(torch.uint8).T,
            pack_pairs_of_halves(codes.reshape(SUPER_BLOCK, -1), SUB_BLOCK),
        ],
        dim=1,
    )
