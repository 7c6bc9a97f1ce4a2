"""C's float32 arithmetic, as ggml-quants.c does it, in torch: the rules every quantizer here follows.

llama.cpp's reference quantizers are C loops over float32 with no fused multiply-add (the oracle is
built with ``-ffp-contract=off``). Matching their bytes needs the same roundings in the same order:

- every elementwise torch op on float32 rounds once, like one C operation, so ``a * b + c`` is
  written as two ops (no ``addcmul``); constants that C writes as float literals (``0.1f``) are made
  float32 first (``float32``) so a Python double never enters;
- a C accumulation loop (``sum += ...``) adds its terms one at a time: ``sequential_sum`` keeps that
  order (``torch.sum`` reduces in another order and rounds differently, which changes the search's
  choices). Data is laid out element-major, ``[elements, blocks]``, so each term is one contiguous
  vector across all blocks and every block's sum is computed at once;
- a float constant over a tensor is divided as C divides (``divide``): torch's
  ``number / tensor`` multiplies by a reciprocal, which rounds twice;
- C's casts of floats to small integers truncate to an ``int`` and keep the low bits;
- C's ``sqrtf`` is correctly rounded, torch's float32 ``sqrt`` on CPU is not (its vectorized kernel
  is off by one unit in the last place for ~0.6% of inputs): ``square_root`` goes through float64.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

# nearest_int's magic: 1.5 * 2**23. Adding it to |v| < 2**22 leaves round-half-even(v) in the low
# mantissa bits.
_ROUNDING_MAGIC = 12582912.0
_TWO_POW_23 = 8388608.0
_TWO_POW_24 = 16777216.0
_MANTISSA_MASK = 0x007FFFFF
_MANTISSA_OFFSET = 0x00400000


def float32(value: float) -> float:
    """``value`` rounded to float32 (what a C ``float`` holds), as a Python float (exact)."""
    return float(np.float32(value))


def divide(numerator: Tensor | float, denominator: Tensor | float) -> Tensor:
    """C's float ``numerator / denominator``, rounded once, where either side may be a constant.

    torch divides by a Python number by multiplying with its reciprocal on some devices, and
    ``number / tensor`` is ``tensor.reciprocal() * number`` everywhere: two roundings, which differ
    from C's one division. Constants are made tensors first so that torch divides elementwise.
    """
    like = numerator if isinstance(numerator, Tensor) else denominator
    if not isinstance(like, Tensor):
        raise TypeError("divide needs at least one tensor")
    top = numerator if isinstance(numerator, Tensor) else torch.full_like(like, numerator)
    bottom = denominator if isinstance(denominator, Tensor) else torch.full_like(like, denominator)
    return torch.div(top, bottom)


def square_root(value: Tensor) -> Tensor:
    """C's ``sqrtf``: the correctly rounded float32 square root.

    The float64 root of a float32 value, rounded to float32, is the correctly rounded float32 root
    (53 >= 2 * 24 + 2 bits, so the double rounding is harmless).
    """
    return torch.sqrt(value.to(torch.float64)).to(torch.float32)


def nearest_int(value: Tensor) -> Tensor:
    """ggml's ``nearest_int``: add 1.5 * 2**23 in float32 and read the mantissa bits (int32).

    Equal to round-half-to-even for |value| < 2**22; beyond that it is what the bit trick gives,
    kept so that even a value C's (disabled) assert would refuse gives C's result.
    """
    shifted = value + _ROUNDING_MAGIC
    return (shifted.view(torch.int32) & _MANTISSA_MASK) - _MANTISSA_OFFSET


def nearest_level(value: Tensor, low: float, high: int) -> Tensor:
    """``MAX(low, MIN(high, nearest_int(value)))`` as float32: the hot path of the searches.

    When every ``value + 1.5 * 2**23`` lies in [2**23, 2**24) (|value| < 2**22, the usual case),
    nearest_int's mantissa bits are exactly that sum minus the magic: two float ops, no integer
    conversion. Otherwise (a huge ratio, inf or NaN in some lane) the bit trick itself runs.
    """
    shifted = value + _ROUNDING_MAGIC
    smallest, largest = torch.aminmax(shifted)
    if bool(smallest >= _TWO_POW_23) and bool(largest < _TWO_POW_24):
        shifted -= _ROUNDING_MAGIC
        return shifted.clamp_(low, high)
    return nearest_int(value).clamp_(int(low), high).to(torch.float32)


def round_half_away(value: Tensor) -> Tensor:
    """C's ``roundf``: round half away from zero, exactly (float32 in, float32 out).

    ``floor(v + 0.5)`` would round 0.49999997 up (the addition rounds); splitting off the integer
    part first keeps every step exact.
    """
    whole = torch.trunc(value)
    fraction = value - whole
    return whole + torch.where(fraction.abs() >= 0.5, torch.sign(value), torch.zeros_like(value))


def truncate_to_int(value: Tensor) -> Tensor:
    """A C cast of a float to an integer type: truncation toward zero, as int32."""
    return torch.trunc(value).to(torch.int32)


def wrap_int8(value: Tensor) -> Tensor:
    """An int32 stored into an ``int8_t`` (x86: the low byte, read as signed)."""
    return ((value + 128) & 0xFF) - 128


def wrap_uint8(value: Tensor) -> Tensor:
    """An int32 stored into a ``uint8_t`` (the low byte)."""
    return value & 0xFF


def sequential_sum(terms: Tensor, start_from_zero: bool = True) -> Tensor:
    """``sum += terms[i]`` for i in order, along dim 0, in float32; one result per column.

    ``start_from_zero`` is C's ``float sum = 0;`` before the loop (0 + -0.0 is +0.0); without it
    the sum starts at ``terms[0]`` (C's ``float sum = x[0];``).
    """
    total = torch.zeros_like(terms[0]) + terms[0] if start_from_zero else terms[0].clone()
    for index in range(1, terms.shape[0]):
        total += terms[index]
    return total


def first_of_largest_magnitude(values: Tensor) -> tuple[Tensor, Tensor]:
    """C's ``if (amax < fabsf(v)) { amax = fabsf(v); max = v; }`` from 0, along dim 0.

    Returns (amax, max): the largest magnitude and the first value that has it, or (0, +0.0)
    when every value is zero (C's ``max`` keeps its initial +0.0 then, even if a value is -0.0).
    A NaN never wins C's comparison, so it counts as zero here (torch's max would return it);
    searches over huge weights overflow to NaN scales.
    """
    magnitudes = values.abs()
    magnitudes = torch.where(torch.isnan(magnitudes), torch.zeros_like(magnitudes), magnitudes)
    amax, index = magnitudes.max(dim=0)
    first = values.gather(0, index.unsqueeze(0)).squeeze(0)
    return amax, torch.where(amax > 0, first, torch.zeros_like(first))


def first_of_extreme(values: Tensor, largest: bool) -> Tensor:
    """C's ``if (v < min) min = v;`` (or ``v > max``) from the first value, along dim 0.

    The first of equal extremes wins, which decides the sign of a zero extreme (-0.0 or +0.0).
    """
    index = values.argmax(dim=0) if largest else values.argmin(dim=0)
    return values.gather(0, index.unsqueeze(0)).squeeze(0)


def fp16_bytes(value: Tensor) -> Tensor:
    """``GGML_FP32_TO_FP16`` (round to nearest even, overflow to inf) as two little-endian bytes.

    ``value`` has shape [n]; the result is uint8 [n, 2].
    """
    return value.to(torch.float16).view(torch.uint8).reshape(-1, 2)


def fp16_round(value: Tensor) -> Tensor:
    """``GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(value))``: the float32 value the block stores."""
    return value.to(torch.float16).to(torch.float32)


def uint16_bytes(value: Tensor) -> Tensor:
    """int32 values in [0, 65535] as two little-endian bytes each (uint8 [n, 2])."""
    return torch.stack([value & 0xFF, (value >> 8) & 0xFF], dim=-1).to(torch.uint8)


def uint32_bytes(value: Tensor) -> Tensor:
    """int64 values in [0, 2**32) as four little-endian bytes each (uint8 [n, 4])."""
    return torch.stack([(value >> shift) & 0xFF for shift in (0, 8, 16, 24)], dim=-1).to(torch.uint8)
