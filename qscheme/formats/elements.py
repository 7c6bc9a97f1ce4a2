"""Element formats: the exact numbers a quantized tensor can hold, and how to round to them.

Every encoder computes in float32 (inputs are upcast, which is exact for fp16 and bf16),
rounds to nearest with ties to even and saturates to the format's largest finite magnitude;
no encoder ever produces an infinity. NaN handling, per format:

- e4m3, e5m2, fp16, bf16, fp32: NaN stays NaN.
- e8m0: NaN encodes as byte 255 (the e8m0 NaN).
- e2m1 and the integer formats have no NaN: NaN encodes as zero (code 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import Tensor

from qscheme.errors import FormatError
from qscheme.formats.table import FORMAT_ALIASES, FORMAT_FACTS, FormatFacts, FormatKind

ElementKind = FormatKind

E2M1_MAGNITUDES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The eight e2m1 magnitudes; code bits 0-2 index this tuple and bit 3 is the sign."""

E8M0_BIAS = 127
E8M0_NAN = 255


class UnknownFormatError(FormatError, KeyError):
    """An element format name that is neither a known format nor an alias."""

    def __str__(self) -> str:
        # KeyError would quote the message; show it as written.
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class ElementFormat:
    """One element format.

    `max_value` is the largest finite value and `min_value` the smallest (most negative)
    finite one; for e8m0, which holds only positive powers of two, `min_value` is 2**-127.
    `storage_dtype` is the dtype `encode` returns. Built from the format's row of
    `qscheme.formats.table` (its other facts: `facts`).
    """

    name: str
    bits: int
    kind: ElementKind
    signed: bool
    max_value: float
    min_value: float
    storage_dtype: torch.dtype

    @property
    def facts(self) -> FormatFacts:
        """The format's row of ``qscheme.formats.table``."""
        return FORMAT_FACTS[self.name]


def _from_table(facts: FormatFacts) -> ElementFormat:
    return ElementFormat(
        facts.name,
        facts.bits,
        facts.kind,
        facts.signed,
        facts.max_value,
        facts.min_value,
        getattr(torch, facts.storage_dtype),
    )


ELEMENT_FORMATS: Mapping[str, ElementFormat] = MappingProxyType(
    {name: _from_table(facts) for name, facts in FORMAT_FACTS.items()}
)
"""Every element format, by canonical name (the rows of ``qscheme.formats.table``)."""


def get_element_format(name: str | ElementFormat) -> ElementFormat:
    """Return the element format called `name` (a canonical name or an alias)."""
    if isinstance(name, ElementFormat):
        return name
    key = FORMAT_ALIASES.get(name, name)
    if key not in ELEMENT_FORMATS:
        allowed = ", ".join([*ELEMENT_FORMATS, *FORMAT_ALIASES])
        raise UnknownFormatError(f"unknown element format {name!r}; known formats: {allowed}")
    return ELEMENT_FORMATS[key]


# --- codecs: encode takes float32 input, decode returns float32 ----------------------------


def _require_dtype(codes: Tensor, fmt: ElementFormat, allowed: tuple[torch.dtype, ...]) -> None:
    if codes.dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise FormatError(
            f"cannot decode {fmt.name} codes stored as {codes.dtype}; expected {names} "
            f"(the dtype encode(x, {fmt.name!r}) returns)"
        )


def _require_integer(codes: Tensor, fmt: ElementFormat) -> None:
    if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
        raise FormatError(
            f"cannot decode {fmt.name} codes stored as {codes.dtype}; expected an integer dtype "
            f"such as {fmt.storage_dtype}"
        )


def _nearest_index_ties_to_even(magnitude: Tensor, table: Tensor) -> Tensor:
    """Index of the nearest entry of the ascending `table`; a tie goes to the even index."""
    midpoints = (table[1:] + table[:-1]) / 2
    strictly_above = torch.bucketize(magnitude, midpoints, right=False)
    at_or_above = torch.bucketize(magnitude, midpoints, right=True)
    on_midpoint_of_odd = (at_or_above != strictly_above) & (strictly_above % 2 == 1)
    return torch.where(on_midpoint_of_odd, at_or_above, strictly_above)


def _encode_e2m1(x: Tensor, fmt: ElementFormat) -> Tensor:
    # The sign bit is `x < 0`, as compressed-tensors sets it: a negative value that rounds
    # to zero keeps its sign (code 0x8) while -0.0 and NaN give code 0.
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=x.device)
    magnitude = torch.where(torch.isnan(x), 0.0, x.abs())
    index = _nearest_index_ties_to_even(magnitude.contiguous(), table)
    return (index | ((x < 0).to(index.dtype) << 3)).to(torch.uint8)


def _decode_e2m1(codes: Tensor, fmt: ElementFormat) -> Tensor:
    _require_integer(codes, fmt)
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=codes.device)
    index = codes.to(torch.int64) & 0x7
    magnitude = table[index]
    negative = ((codes.to(torch.int64) & 0x8) != 0) & (index != 0)  # 0x8 decodes to +0.0
    return torch.where(negative, -magnitude, magnitude)


def _encode_torch_float(x: Tensor, fmt: ElementFormat) -> Tensor:
    # torch's float casts round to nearest even; clamping first saturates (and keeps NaN).
    return x.clamp(fmt.min_value, fmt.max_value).to(fmt.storage_dtype)


def _decode_torch_float(codes: Tensor, fmt: ElementFormat) -> Tensor:
    if fmt.bits == 8 and codes.dtype in (torch.uint8, torch.int8):
        codes = codes.view(fmt.storage_dtype)  # raw bytes of an fp8 tensor
    _require_dtype(codes, fmt, (fmt.storage_dtype,))
    return codes.to(torch.float32)


def _encode_int(x: Tensor, fmt: ElementFormat) -> Tensor:
    rounded = torch.round(x).clamp(fmt.min_value, fmt.max_value)  # torch.round: half to even
    return torch.where(torch.isnan(rounded), 0.0, rounded).to(fmt.storage_dtype)


def _decode_int(codes: Tensor, fmt: ElementFormat) -> Tensor:
    _require_integer(codes, fmt)
    return codes.to(torch.float32)


_F32_MANTISSA_BITS = 23
_F32_SMALLEST_NORMAL = 2.0**-126
_E8M0_SMALLEST = 2.0**-E8M0_BIAS


def _encode_e8m0(x: Tensor, fmt: ElementFormat) -> Tensor:
    # Nearest power of two by value; a tie (1.5 * 2**k) goes to the even byte. Zero and
    # values below 2**-127 saturate to byte 0, values above 2**127 (and +inf) to byte 254.
    if bool((x < 0).any()):
        raise FormatError(
            f"e8m0 holds only positive powers of two, got a negative value "
            f"(min {float(x.min())}); encode the absolute value or check the scale computation"
        )
    bits = x.abs().contiguous().view(torch.int32).to(torch.int64)
    exponent_lsb = (bits >> _F32_MANTISSA_BITS) & 1
    half_minus_one = (1 << (_F32_MANTISSA_BITS - 1)) - 1
    normal = (bits + half_minus_one + exponent_lsb) >> _F32_MANTISSA_BITS
    # Below 2**-126 float32 is subnormal and the bit trick does not apply; the only
    # candidates there are bytes 0 (2**-127) and 1 (2**-126), split at 1.5 * 2**-127.
    subnormal = (x > 1.5 * _E8M0_SMALLEST).to(torch.int64)
    byte = torch.where(x < _F32_SMALLEST_NORMAL, subnormal, normal).clamp(0, E8M0_NAN - 1)
    return torch.where(torch.isnan(x), E8M0_NAN, byte).to(torch.uint8)


def _decode_e8m0(codes: Tensor, fmt: ElementFormat) -> Tensor:
    _require_dtype(codes, fmt, (torch.uint8,))
    exponent = codes.to(torch.int32)
    # Build the float32 bit pattern directly: exact for every byte, including 2**-127
    # (a float32 subnormal, bit 22 set) and NaN for byte 255.
    bits = torch.where(exponent == 0, 1 << (_F32_MANTISSA_BITS - 1), exponent << _F32_MANTISSA_BITS)
    bits = torch.where(exponent == E8M0_NAN, 0x7FC00000, bits)
    return bits.view(torch.float32)


_Encoder = Callable[[Tensor, ElementFormat], Tensor]
_Decoder = Callable[[Tensor, ElementFormat], Tensor]

_CODECS: Mapping[str, tuple[_Encoder, _Decoder]] = MappingProxyType(
    {
        "e2m1": (_encode_e2m1, _decode_e2m1),
        "e4m3": (_encode_torch_float, _decode_torch_float),
        "e5m2": (_encode_torch_float, _decode_torch_float),
        "e8m0": (_encode_e8m0, _decode_e8m0),
        "int2": (_encode_int, _decode_int),
        "int3": (_encode_int, _decode_int),
        "int4": (_encode_int, _decode_int),
        "uint4": (_encode_int, _decode_int),
        "int8": (_encode_int, _decode_int),
        "uint8": (_encode_int, _decode_int),
        "fp16": (_encode_torch_float, _decode_torch_float),
        "bf16": (_encode_torch_float, _decode_torch_float),
        "fp32": (_encode_torch_float, _decode_torch_float),
    }
)


# --- public API ------------------------------------------------------------------------------


def encode(x: Tensor, fmt: str | ElementFormat) -> Tensor:
    """Round `x` to `fmt` (nearest, ties to even, saturating) and return its stored codes.

    The result has `fmt.storage_dtype`: e2m1 gives uint8 codes 0..15 (bit 3 the sign; a
    negative value that rounds to zero gives 0x8, -0.0 gives 0, as compressed-tensors does),
    e8m0 the uint8 biased exponent (the input must not be negative), integer formats the
    rounded integers, float formats values of that torch dtype. See the module docstring
    for NaN handling. float64 input is first rounded to float32.
    """
    element = get_element_format(fmt)
    if not x.dtype.is_floating_point:
        raise FormatError(
            f"encode(x, {element.name!r}) needs a floating-point tensor, got {x.dtype}; convert it with x.float() first"
        )
    return _CODECS[element.name][0](x.to(torch.float32), element)


def decode(codes: Tensor, fmt: str | ElementFormat) -> Tensor:
    """Return the float32 values of stored `codes` of format `fmt`.

    e2m1 code 0x8 (negative zero) decodes to +0.0 and e8m0 byte 255 to NaN. fp8 codes may
    also be given as their raw uint8 bytes.
    """
    element = get_element_format(fmt)
    return _CODECS[element.name][1](codes, element)


def round_to_format(x: Tensor, fmt: str | ElementFormat) -> Tensor:
    """Return `x` rounded to the nearest value of `fmt`, as float32 (decode of encode)."""
    element = get_element_format(fmt)
    return decode(encode(x, element), element)


def all_codes(fmt: str | ElementFormat) -> Tensor:
    """Every code of a format of at most 8 bits, in `fmt.storage_dtype`, NaN codes included."""
    element = get_element_format(fmt)
    if element.bits > 8:
        raise FormatError(
            f"{element.name} has 2**{element.bits} codes; all_codes and representable_values "
            f"cover formats of at most 8 bits"
        )
    if element.storage_dtype.is_floating_point:
        return torch.arange(1 << element.bits, dtype=torch.uint8).view(element.storage_dtype)
    if element.kind == "int":
        low, high = int(element.min_value), int(element.max_value)
        return torch.arange(low, high + 1).to(element.storage_dtype)
    return torch.arange(1 << element.bits).to(element.storage_dtype)


def representable_values(fmt: str | ElementFormat) -> Tensor:
    """The distinct finite values of a format of at most 8 bits, ascending, float32.

    Negative zero is folded into +0.0.
    """
    values = decode(all_codes(fmt), fmt)
    finite = values[torch.isfinite(values)] + 0.0  # -0.0 + 0.0 == +0.0
    return torch.unique(finite, sorted=True)


# --- MX block scales -------------------------------------------------------------------------

# compressed-tensors' generate_mx_scales: the offset is floor(log2(element max)), and the
# rounding to a power of two uses e2m1's single mantissa bit for every MX element type.
_MX_ELEMENTS: Mapping[str, int] = MappingProxyType({"e2m1": 1, "e4m3": 1})

# float dtype -> (same-width integer dtype, mantissa bits, exponent bits)
_BIT_LAYOUTS: Mapping[torch.dtype, tuple[torch.dtype, int, int]] = MappingProxyType(
    {
        torch.bfloat16: (torch.int16, 7, 8),
        torch.float16: (torch.int16, 10, 5),
        torch.float32: (torch.int32, 23, 8),
        torch.float64: (torch.int64, 52, 11),
    }
)


def mx_scale_exponent(absmax: Tensor, element: str | ElementFormat = "e2m1") -> Tensor:
    """The e8m0 byte compressed-tensors stores as the MX scale of a group with this absmax.

    Reproduces compressed-tensors' generate_mx_scales followed by its rounding to uint8, bit
    for bit, computed in the dtype of `absmax` as compressed-tensors does:
    `p = 2**floor(log2(absmax))`, doubled when absmax >= 1.75 * p (the mantissa rounded to
    one bit, half up); byte = 127 + log2(p) - floor(log2(element max)), clamped to [0, 255].
    The scale is not the nearest power of two above absmax / element max: for e2m1 an
    absmax in [1.5p, 1.75p) scales to (6, 7) and saturates to 6. An all-zero group gives
    byte 0, infinity and NaN give 255. `absmax` must not be negative.

    compressed-tensors then turns the byte into the float scale 2**(byte-127) in the absmax
    dtype and back; where that scale underflows to zero (float16 only: an absmax below
    2**-14, such as an all-zero group) it replaces the scale by 1.0 and so stores byte 127.
    This function returns the stored byte, so it gives 127 there too.
    """
    fmt = get_element_format(element)
    if fmt.name not in _MX_ELEMENTS:
        raise FormatError(f"no MX scale rule for element format {fmt.name!r}; MX elements: {', '.join(_MX_ELEMENTS)}")
    if absmax.dtype not in _BIT_LAYOUTS:
        raise FormatError(f"mx_scale_exponent needs a float absmax (bf16, fp16, fp32 or fp64), got {absmax.dtype}")
    if bool((absmax < 0).any()):
        raise FormatError(f"an absmax cannot be negative, got min {float(absmax.min())}")
    int_dtype, mantissa_bits, exponent_bits = _BIT_LAYOUTS[absmax.dtype]
    exponent_all_ones = (1 << exponent_bits) - 1
    bias = (1 << (exponent_bits - 1)) - 1
    offset = math.floor(math.log2(fmt.max_value))
    round_up = 1 << (mantissa_bits - _MX_ELEMENTS[fmt.name] - 1)

    magnitude = torch.where(torch.isnan(absmax), math.inf, absmax.abs()).contiguous()
    bits = magnitude.view(int_dtype).to(torch.int64)
    exponent_field = ((bits + round_up) >> mantissa_bits).clamp(max=exponent_all_ones)
    byte = (exponent_field - bias + E8M0_BIAS - offset).clamp(0, E8M0_NAN)
    byte = torch.where(exponent_field == 0, 0, byte)  # log2(0) = -inf -> 0
    byte = torch.where(exponent_field == exponent_all_ones, E8M0_NAN, byte)  # log2(inf) -> 255
    # Bytes whose scale 2**(byte-127) is below the dtype's smallest subnormal become 127.
    smallest_subnormal_exponent = 1 - bias - mantissa_bits
    underflows = byte - E8M0_BIAS < smallest_subnormal_exponent
    return torch.where(underflows, E8M0_BIAS, byte).to(torch.uint8)
