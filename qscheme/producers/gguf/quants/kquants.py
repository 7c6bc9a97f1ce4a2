"""ggml's k-quants, 256 weights a super-block: Q2_K, Q3_K, Q4_K, Q5_K and Q6_K.

Each mirrors ``quantize_row_<type>_ref`` of ggml-quants.c (what ``quantize_<type>`` runs without an
importance matrix): a scale search per sub-block (kquant_search), the sub-block scales quantized
against one fp16 super-block scale, then the weights re-rounded with the scales as stored, except
in a sub-block whose stored scale is zero, which keeps the search's levels. Every function takes
super-blocks element-major, float32 ``[256, blocks]``, and returns uint8 ``[blocks, block_bytes]``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qscheme.producers.gguf.quants.c_float import (
    divide,
    first_of_largest_magnitude,
    fp16_bytes,
    fp16_round,
    nearest_int,
    sequential_sum,
    square_root,
    wrap_int8,
    wrap_uint8,
)
from qscheme.producers.gguf.quants.kquant_search import (
    GROUP_MAX_EPS,
    make_q3_quants,
    make_qkx2_quants,
    make_qx_quants_rmse,
)
from qscheme.producers.gguf.quants.packing import pack_bit_planes, pack_crumbs, pack_pairs_of_halves

SUPER_BLOCK = 256


def _split(blocks: Tensor, size: int) -> Tensor:
    """``[256, blocks]`` -> ``[size, sub-blocks]``: one sub-block per column, ordered (sub, block)."""
    count = SUPER_BLOCK // size
    return blocks.reshape(count, size, -1).permute(1, 0, 2).reshape(size, -1)


def _join(levels: Tensor, size: int) -> Tensor:
    """The inverse of ``_split``: ``[size, sub-blocks]`` -> ``[256, blocks]``."""
    count = SUPER_BLOCK // size
    return levels.reshape(size, count, -1).permute(1, 0, 2).reshape(SUPER_BLOCK, -1)


def _positive_max(values: Tensor) -> Tensor:
    """C's ``max = 0; if (v > max) max = v;`` along dim 0 (+0.0 when nothing is positive; a NaN
    never wins C's comparison, torch's amax would return it)."""
    largest = torch.where(torch.isnan(values), torch.zeros_like(values), values).amax(dim=0)
    return torch.where(largest > 0, largest, torch.zeros_like(largest))


def _requantize(blocks: Tensor, levels: Tensor, step: Tensor, offset: Tensor | None, size: int, top: int) -> Tensor:
    """C's final pass: ``l = nearest_int((x + offset) / step)`` clamped to 0..top in every sub-block
    whose ``step`` (its stored scale) is non-zero; other sub-blocks keep ``levels``.

    ``step`` and ``offset`` are ``[sub-blocks per block, blocks]``; blocks and levels ``[256, blocks]``.
    """
    count = SUPER_BLOCK // size
    grouped = blocks.reshape(count, size, -1)
    shifted = grouped if offset is None else grouped + offset.unsqueeze(1)
    fresh = torch.clamp(nearest_int(shifted / step.unsqueeze(1)), 0, top)
    keep = (step == 0).unsqueeze(1)
    return torch.where(keep, levels.reshape(count, size, -1), fresh).reshape(SUPER_BLOCK, -1)


def _six_bit_pairs(scale_codes: Tensor, min_codes: Tensor) -> Tensor:
    """Q4_K's and Q5_K's 12 scale bytes from 8 six-bit scales and 8 six-bit mins ``[8, blocks]``."""
    low_scales, high_scales = scale_codes[:4], scale_codes[4:]
    low_mins, high_mins = min_codes[:4], min_codes[4:]
    first = low_scales | ((high_scales >> 4) << 6)
    second = low_mins | ((high_mins >> 4) << 6)
    third = (high_scales & 0xF) | ((high_mins & 0xF) << 4)
    return torch.cat([first, second, third], dim=0).to(torch.uint8).T


def _asymmetric_32(blocks: Tensor, nmax: int, rmin: float, rdelta: float, nstep: int) -> tuple[Tensor, Tensor]:
    """Q4_K and Q5_K: sub-blocks of 32 with a six-bit scale and min each, weights av|x| + |x|.

    Returns (the 16 header bytes: fp16 d, fp16 dmin, 12 scale bytes; levels [256, blocks]).
    """
    sub = _split(blocks, 32)
    sum_x2 = sequential_sum(sub * sub)
    average = square_root(divide(sum_x2, 32.0))
    weights = average + sub.abs()
    levels, scales, mins = make_qkx2_quants(sub, weights, nmax, rmin, rdelta, nstep, use_mad=False)
    scales, mins = scales.reshape(8, -1), mins.reshape(8, -1)

    max_scale, max_min = _positive_max(scales), _positive_max(mins)
    inverse_scale = torch.where(max_scale > 0, divide(63.0, max_scale), torch.zeros_like(max_scale))
    inverse_min = torch.where(max_min > 0, divide(63.0, max_min), torch.zeros_like(max_min))
    scale_codes = torch.clamp_max(wrap_uint8(nearest_int(inverse_scale * scales)), 63)
    min_codes = torch.clamp_max(wrap_uint8(nearest_int(inverse_min * mins)), 63)
    d, dmin = divide(max_scale, 63.0), divide(max_min, 63.0)

    step = fp16_round(d) * scale_codes.to(torch.float32)
    offset = fp16_round(dmin) * min_codes.to(torch.float32)
    levels = _requantize(blocks, _join(levels, 32), step, offset, 32, nmax)
    header = torch.cat([fp16_bytes(d), fp16_bytes(dmin), _six_bit_pairs(scale_codes, min_codes)], dim=1)
    return header, levels


def quantize_q4_k(blocks: Tensor) -> Tensor:
    """Q4_K: fp16 d, fp16 dmin, 12 bytes of six-bit scales and mins, 128 bytes of nibbles."""
    header, levels = _asymmetric_32(blocks, 15, -1.0, 0.1, 20)
    return torch.cat([header, pack_pairs_of_halves(levels, 64)], dim=1)


def quantize_q5_k(blocks: Tensor) -> Tensor:
    """Q5_K: as Q4_K with 5-bit levels: 32 bytes of 5th bits (bit t of byte j: weight 32 t + j),
    then 128 bytes of low nibbles."""
    header, levels = _asymmetric_32(blocks, 31, -0.5, 0.1, 15)
    high_bits = pack_bit_planes(levels.reshape(8, 32, -1).permute(1, 0, 2).reshape(SUPER_BLOCK, -1) >> 4)
    return torch.cat([header, high_bits, pack_pairs_of_halves(levels, 64)], dim=1)


def quantize_q2_k(blocks: Tensor) -> Tensor:
    """Q2_K: 16 bytes of 4-bit scale and min codes, 64 bytes of 2-bit levels, fp16 d, fp16 dmin."""
    sub = _split(blocks, 16)
    levels, scales, mins = make_qkx2_quants(sub, sub.abs(), 3, -0.5, 0.1, 15, use_mad=True)
    scales, mins = scales.reshape(16, -1), mins.reshape(16, -1)

    max_scale, max_min = _positive_max(scales), _positive_max(mins)
    has_scale, has_min = max_scale > 0, max_min > 0
    scale_codes = torch.where(has_scale, nearest_int(divide(15.0, max_scale) * scales), 0)
    min_codes = torch.where(has_min, nearest_int(divide(15.0, max_min) * mins), 0)
    codes = wrap_uint8(scale_codes | (min_codes << 4))
    zero = torch.zeros_like(max_scale)
    d = torch.where(has_scale, divide(max_scale, 15.0), zero)
    dmin = torch.where(has_min, divide(max_min, 15.0), zero)

    step = fp16_round(d) * (codes & 0xF).to(torch.float32)
    offset = fp16_round(dmin) * (codes >> 4).to(torch.float32)
    levels = _requantize(blocks, _join(levels, 16), step, offset, 16, 3)
    return torch.cat([codes.to(torch.uint8).T, pack_crumbs(levels), fp16_bytes(d), fp16_bytes(dmin)], dim=1)


def _q3_scale_bytes(codes: Tensor) -> Tensor:
    """Q3_K's 12 scale bytes from 16 six-bit codes ``[16, blocks]``: low nibbles of codes j and
    j + 8 in byte j, the top two bits of code j at bits 2 (j / 4) of byte 8 + j % 4."""
    low = (codes[:8] & 0xF) | ((codes[8:] & 0xF) << 4)
    top = (codes >> 4).reshape(4, 4, -1)
    high = top[0] | (top[1] << 2) | (top[2] << 4) | (top[3] << 6)
    return torch.cat([low, high], dim=0).to(torch.uint8).T


def quantize_q3_k(blocks: Tensor) -> Tensor:
    """Q3_K: 32 bytes of high bits (bit t of byte m: weight 32 t + m), 64 bytes of 2-bit levels,
    12 bytes of six-bit signed scales, fp16 d."""
    levels, scales = make_q3_quants(_split(blocks, 16), 4)
    scales = scales.reshape(16, -1)
    _, max_scale = first_of_largest_magnitude(scales)
    nonzero = max_scale != 0
    inverse = divide(-32.0, max_scale)
    codes = torch.clamp(wrap_int8(nearest_int(inverse * scales)), -32, 31) + 32
    codes = torch.where(nonzero, codes, 0)
    d = torch.where(nonzero, divide(1.0, inverse), torch.zeros_like(max_scale))

    step = fp16_round(d) * (torch.where(nonzero, codes, 0) - 32).to(torch.float32)
    shifted = blocks.reshape(16, 16, -1) / step.unsqueeze(1)
    fresh = torch.clamp(nearest_int(shifted), -4, 3) + 4
    joined = _join(levels, 16).reshape(16, 16, -1)
    levels = torch.where((step == 0).unsqueeze(1), joined, fresh).reshape(SUPER_BLOCK, -1)

    high = pack_bit_planes((levels > 3).to(torch.int32).reshape(8, 32, -1).permute(1, 0, 2).reshape(SUPER_BLOCK, -1))
    return torch.cat([high, pack_crumbs(levels & 3), _q3_scale_bytes(codes), fp16_bytes(d)], dim=1)


def quantize_q6_k(blocks: Tensor) -> Tensor:
    """Q6_K: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8 scales, fp16 d.

    A super-block whose sub-block scales are all below GROUP_MAX_EPS is written as zeros.
    """
    levels, scales = make_qx_quants_rmse(_split(blocks, 16), 32)
    scales = scales.reshape(16, -1)
    max_abs_scale, max_scale = first_of_largest_magnitude(scales)
    inverse = divide(-128.0, max_scale)
    codes = wrap_int8(torch.clamp_max(nearest_int(inverse * scales), 127))
    d = divide(1.0, inverse)

    step = fp16_round(d) * codes.to(torch.float32)
    shifted = blocks.reshape(16, 16, -1) / step.unsqueeze(1)
    fresh = torch.clamp(nearest_int(shifted), -32, 31) + 32
    joined = _join(levels, 16).reshape(16, 16, -1)
    levels = torch.where((step == 0).unsqueeze(1), joined, fresh).reshape(SUPER_BLOCK, -1)

    packed = torch.cat(
        [
            pack_pairs_of_halves(levels & 0xF, 128),
            pack_crumbs(levels >> 4),
            wrap_uint8(codes).to(torch.uint8).T,
            fp16_bytes(d),
        ],
        dim=1,
    )
    zero_block = (max_abs_scale < GROUP_MAX_EPS).unsqueeze(1)
    return torch.where(zero_block, torch.zeros_like(packed), packed)
