"""Exact rounding of scaled weights to element codes, by table lookup.

Rounding to an 8-bit-or-narrower format only depends on where a value lies relative to the
rounding boundaries (the midpoints between neighbouring representable values). Every such
boundary has few significant bits, so the leading bits of a float32 value, plus one "sticky"
bit saying whether any of the remaining bits is set, decide the result exactly: a value equal
to a boundary and a value just above it get different keys, and no key spans a boundary. The
table maps each key to the code the rounding rule gives a representative value of that key,
which makes a lookup bit-identical to the rule while costing a few integer passes and one
gather instead of a binary search per element.

A rule is: the element format, how ties break (``even``: round half to even, as torch casts
and ``torch.round`` do; ``down``: toward the smaller magnitude, as ModelOpt's MXFP4 cast does),
and how zeros and negative values set the sign (``sign_of_zero``):

- ``"keep"``: the code of -0.0 is the format's negative zero where it has one (torch casts);
- ``"positive"``: -0.0 is stored as +0 (compressed-tensors adds a zero point first);
- ``"negative-below-zero"``: e2m1's sign bit is set exactly for values below zero, so -0.0
  gives code 0 and a negative value rounding to zero gives 0x8 (compressed-tensors, ModelOpt
  NVFP4);
- ``"not-positive"``: e2m1's sign bit is set for every value that is not above zero, +0.0
  included (ModelOpt MXFP4, via ``(2 - sign(x)) // 2``).
"""

from __future__ import annotations

import math
from functools import cache

import torch
from torch import Tensor

from qscheme.formats import encode, get_element_format, representable_values

_FLOAT32_MANTISSA_BITS = 23
_E2M1_SIGN = 0x8


@cache
def _key_mantissa_bits(element: str) -> int:
    """Mantissa bits a key keeps so that every rounding boundary of ``element`` has a zero
    in the key's last bit (boundaries need at most ``bits - 1`` mantissa bits)."""
    values = representable_values(element).double()
    boundaries = ((values[1:] + values[:-1]) / 2).abs()
    boundaries = boundaries[boundaries > 0]
    needed = 0
    for boundary in boundaries.tolist():
        mantissa, _ = math.frexp(boundary)  # boundary = mantissa * 2**e, 0.5 <= mantissa < 1
        bits = 0
        while mantissa != math.floor(mantissa):
            mantissa *= 2
            bits += 1
        needed = max(needed, bits)  # significant bits of the boundary
    return max(needed, 1)


def _sticky_keys(values: Tensor, shift: int) -> Tensor:
    """int32 keys: the float32 bit pattern shifted right by ``shift`` with a sticky last bit."""
    bits = values.contiguous().view(torch.int32)
    sticky = (bits & ((1 << shift) - 1)).ne_(0)
    keys = bits.bitwise_right_shift(shift).bitwise_and_((1 << (32 - shift)) - 1)
    return keys.bitwise_or_(sticky)


@cache
def rounding_table(element: str, ties: str = "even", sign_of_zero: str = "keep") -> tuple[Tensor, int]:
    """(table, shift): ``table[key(x)]`` is the code of float32 ``x``; see the module docstring.

    Codes are uint8: e2m1 codes, two's-complement bytes of signed integers, unsigned integers,
    or the raw bytes of float8 values.
    """
    fmt = get_element_format(element)
    shift = _FLOAT32_MANTISSA_BITS - _key_mantissa_bits(fmt.name)
    keys = torch.arange(1 << (32 - shift), dtype=torch.int64)
    representatives = (keys << shift).to(torch.int32).view(torch.float32)
    if ties == "even":
        codes = encode(representatives, fmt)
    elif ties == "down":
        codes = _encode_ties_down(representatives, fmt.name)
    else:
        raise ValueError(f"unknown tie rule {ties!r}; use 'even' or 'down'")
    codes = _apply_sign_of_zero(codes, representatives, fmt.name, sign_of_zero)
    if codes.dtype != torch.uint8:
        codes = codes.contiguous().view(torch.uint8)  # int8 / float8 bytes
    return codes.contiguous(), shift


def _encode_ties_down(values: Tensor, element: str) -> Tensor:
    magnitudes = representable_values(element)
    magnitudes = magnitudes[magnitudes >= 0]
    midpoints = (magnitudes[1:] + magnitudes[:-1]) / 2
    index = torch.searchsorted(midpoints, values.abs().contiguous(), right=False)
    nearest = magnitudes[index.clamp(max=len(magnitudes) - 1)]
    return encode(torch.where(values < 0, -nearest, nearest), element)


def _apply_sign_of_zero(codes: Tensor, values: Tensor, element: str, rule: str) -> Tensor:
    if rule == "keep":
        return codes
    if rule == "positive":
        return torch.where((values == 0) & torch.signbit(values), encode(torch.zeros(1), element), codes)
    if element != "e2m1":
        raise ValueError(f"sign rule {rule!r} applies to e2m1 only, not {element!r}")
    magnitude = codes & ~_E2M1_SIGN
    if rule == "negative-below-zero":
        return magnitude | torch.where(values < 0, _E2M1_SIGN, 0).to(torch.uint8)
    if rule == "not-positive":
        return magnitude | torch.where(values > 0, 0, _E2M1_SIGN).to(torch.uint8)
    raise ValueError(f"unknown sign rule {rule!r}")


def round_to_codes(values: Tensor, table: Tensor, shift: int) -> Tensor:
    """The uint8 codes of ``values`` (any float dtype; widened to float32, which is exact)."""
    if values.dtype != torch.float32:
        values = values.to(torch.float32)
    keys = _sticky_keys(values, shift)
    return table.index_select(0, keys.view(-1)).view(values.shape)
