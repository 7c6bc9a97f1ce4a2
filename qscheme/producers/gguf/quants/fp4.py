"""ggml's FP4 (E2M1) quants: MXFP4 (32 weights, an E8M0 power-of-two scale) and NVFP4 (64 weights,
four 16-weight sub-blocks with a UE4M3 scale each).

Each mirrors ``quantize_row_mxfp4_ref`` / ``quantize_row_nvfp4_ref`` of ggml-quants.c (what
``quantize_mxfp4`` / ``quantize_nvfp4`` run; neither uses an importance matrix): a scale from the
block's largest magnitude, then every weight takes the first of the 16 doubled E2M1 values
(``FP4_DOUBLED_VALUES``) whose ``|value * scale - x|`` is smallest. Functions take blocks
element-major, float32 ``[block_elements, blocks]``, and return uint8 ``[blocks, block_bytes]``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from qscheme.producers.gguf.quants.c_float import divide, truncate_to_int, wrap_uint8
from qscheme.producers.gguf.quants.packing import pack_nibble_halves, pack_pairs_of_halves

# ggml's kvalues_fp4: E2M1 values times two, in code order (codes 8..15 are the negatives).
FP4_DOUBLED_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
NVFP4_SUB_BLOCK = 16
# UE4M3 codes that ggml_fp32_to_ue4m3 writes: 0..0x7E (0x7F would be NaN).
_UE4M3_CODES = 0x80


def _ue4m3_halves() -> Tensor:
    """``ggml_ue4m3_to_fp32(code)`` for every 7-bit code: the UE4M3 value times 0.5 (0 for 0, 0x7F)."""
    values = np.zeros(_UE4M3_CODES, np.float32)
    for code in range(1, 0x7F):
        exponent, mantissa = code >> 3, code & 0x7
        raw = mantissa * 2.0**-9 if exponent == 0 else (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)
        values[code] = raw * 0.5  # exact: at most 4 significant bits
    return torch.from_numpy(values)


_UE4M3_HALVES = _ue4m3_halves()


def _largest_magnitude(values: Tensor, dim: int) -> Tensor:
    """C's ``amax = 0; if (amax < fabsf(v)) amax = fabsf(v);`` along ``dim``."""
    return values.abs().amax(dim=dim)


def nearest_value_index(values: Tensor, scale: Tensor) -> Tensor:
    """ggml's ``best_index_mxfp4(x, e)`` (int32): the first code whose ``|kvalues[i] * e - x|`` is
    strictly the smallest, each product and difference rounded in float32 as C does.

    ``values`` is ``[elements, blocks]`` (or more leading dims), ``scale`` broadcasts against it.
    """
    best_error = (FP4_DOUBLED_VALUES[0] * scale - values).abs()
    best_index = torch.zeros_like(values, dtype=torch.int32)
    for index in range(1, len(FP4_DOUBLED_VALUES)):
        error = (FP4_DOUBLED_VALUES[index] * scale - values).abs()
        better = error < best_error
        best_index = torch.where(better, index, best_index)
        best_error = torch.where(better, error, best_error)
    return best_index


def e8m0_exponent(amax: Tensor) -> Tensor:
    """MXFP4's scale byte: ``amax > 0 ? (uint8_t)(floorf(log2f(amax)) - 2 + 127) : 0`` (int32).

    log2f's result is rounded to float32 before the floor, so an amax just below a power of two
    can floor to that power's exponent: the float64 log2 rounded to float32 reproduces that
    (glibc's log2f floors the same on every power of two's neighbours). Below 2**-125 the C cast
    of a negative float to uint8_t keeps the low byte of the int (x86).
    """
    log2 = torch.log2(amax.to(torch.float64)).to(torch.float32)
    exponent = wrap_uint8(truncate_to_int(torch.floor(log2) - 2.0 + 127.0))
    return torch.where(amax > 0, exponent, 0)


def e8m0_half(exponent: Tensor) -> Tensor:
    """``GGML_E8M0_TO_FP32_HALF(e)``: 2**(e - 128) as float32, built from its bits (e < 2 subnormal)."""
    subnormal = torch.full_like(exponent, 0x00200000) << exponent.clamp(max=1)
    bits = torch.where(exponent < 2, subnormal, (exponent - 1) << 23)
    return bits.to(torch.int32).view(torch.float32)


def ue4m3_code(value: Tensor) -> Tensor:
    """``ggml_fp32_to_ue4m3(value)`` (int32): 4 exponent bits (bias 7), 3 mantissa bits, rounding
    half up on the mantissa's next bit; subnormals ``(int)(value * 512 + 0.5)`` in 1..7; 0 for
    anything not positive, 0x7E (448) for anything from 256 up."""
    clipped = torch.clamp_max(value, 448.0)
    bits = clipped.view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127 + 7
    mantissa = ((bits >> 20) & 0x7) + ((bits >> 19) & 1)
    carry = mantissa > 7
    exponent = exponent + carry.to(torch.int32)
    mantissa = torch.where(carry, 0, mantissa)
    normal = torch.where(exponent >= 15, 0x7E, (exponent << 3) | mantissa)
    subnormal = truncate_to_int(clipped * 512.0 + 0.5).clamp_max(7)
    subnormal = torch.where(subnormal < 1, 0, subnormal)
    # The subnormal test uses the exponent before rounding (C returns from that branch first).
    code = torch.where(((bits >> 23) & 0xFF) - 127 + 7 <= 0, subnormal, normal)
    return torch.where(value > 0, code, 0)


def quantize_mxfp4(blocks: Tensor) -> Tensor:
    """MXFP4: one E8M0 exponent byte, then 16 bytes of E2M1 codes (element j low nibble, j + 16 high)."""
    exponent = e8m0_exponent(_largest_magnitude(blocks, 0))
    codes = nearest_value_index(blocks, e8m0_half(exponent))
    return torch.cat([exponent.to(torch.uint8).unsqueeze(1), pack_nibble_halves(codes)], dim=1)


def quantize_nvfp4(blocks: Tensor) -> Tensor:
    """NVFP4: four UE4M3 sub-block scale bytes, then 32 bytes of E2M1 codes (8 per sub-block of 16:
    byte j holds its elements j and j + 8)."""
    grouped = blocks.reshape(blocks.shape[0] // NVFP4_SUB_BLOCK, NVFP4_SUB_BLOCK, -1)
    codes_of_scale = ue4m3_code(divide(_largest_magnitude(grouped, 1), 6.0))  # [sub-blocks, blocks]
    scale = _UE4M3_HALVES.to(blocks.device)[codes_of_scale.long()]
    codes = nearest_value_index(grouped, scale.unsqueeze(1)).reshape(blocks.shape[0], -1)
    return torch.cat([codes_of_scale.to(torch.uint8).T, pack_pairs_of_halves(codes, NVFP4_SUB_BLOCK)], dim=1)
