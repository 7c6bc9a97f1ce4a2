"""The facts of every element format, in one torch-free table that every layer reads.

A row says what a format is (bits, integer or float, signedness, range, exponent and
mantissa widths), how it is stored (the dtype its codes come in) and where a scheme
descriptor may name it (weight, activation, scale). Everything else about a format is
derived from its row: how many fit in a byte or an int32 word, its smallest normal and
subnormal values, the range half compressed-tensors divides an absmax by.

The encoders and decoders stay with the code that runs them, keyed by the format's name:
``qscheme.formats.elements`` (torch) and ``qscheme.triton.decode`` (Triton). Adding an
element format means one row here plus its decoders there.

This module imports no torch: the descriptor parser and the kernel declarations read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from math import gcd
from types import MappingProxyType
from typing import Literal

FormatKind = Literal["float", "int", "scale"]


@dataclass(frozen=True)
class FormatFacts:
    """One element format's facts.

    ``kind`` is ``float`` or ``int`` for formats that hold values and ``scale`` for one that
    only holds scales (e8m0: positive powers of two). ``max_value`` is the largest finite
    value and ``min_value`` the smallest (most negative) one; for e8m0 ``min_value`` is its
    smallest value, 2**-127. ``storage_dtype`` names the torch dtype its codes are stored in
    (what ``qscheme.formats.encode`` returns). ``exponent_bits`` and ``mantissa_bits`` are
    zero for integer formats. ``family`` is the descriptor's weight family of the element on
    its own (``fp8``, ``int4``, ...; None for formats a weight cannot have). ``weight``,
    ``activation`` and ``scale`` say whether a descriptor's weight ``format``, activation
    ``format`` or a scale ``format`` may name it.
    """

    name: str
    kind: FormatKind
    bits: int
    signed: bool
    max_value: float
    min_value: float
    storage_dtype: str
    exponent_bits: int = 0
    mantissa_bits: int = 0
    family: str | None = None
    weight: bool = False
    activation: bool = False
    scale: bool = False

    @property
    def scale_only(self) -> bool:
        """Whether the format holds scales only (never a weight or activation element)."""
        return self.kind == "scale"

    @property
    def per_byte(self) -> int:
        """Elements per byte when packed (2 for 4-bit formats)."""
        return max(1, 8 // self.bits)

    @property
    def per_int32(self) -> int:
        """Whole elements per int32 word when packed (8 for 4-bit formats, 4 for 8-bit ones; 10 for
        3-bit ones, whose bit stream also straddles words: see ``int32_run``)."""
        return max(1, 32 // self.bits)

    @property
    def int32_run(self) -> tuple[int, int]:
        """(elements, int32 words) of the shortest run of a dense bit stream that fills whole words:
        (8, 1) for 4-bit formats, (16, 1) for 2-bit, (32, 3) for 3-bit (codes straddle words)."""
        common = gcd(32, self.bits)
        return 32 // common, self.bits // common

    @property
    def coded(self) -> bool:
        """Whether its values are codes that must be decoded (8 bits or fewer), not a 16- or
        32-bit float a kernel loads as is."""
        return self.bits <= 8

    @property
    def range_half(self) -> float:
        """compressed-tensors' ``(q_max - q_min) / 2``: 6 for e2m1, 448 for e4m3, 127.5 for int8."""
        return (self.max_value - self.min_value) / 2

    @property
    def smallest_normal(self) -> float:
        """The smallest positive normal value (1 for integers, 2**-127 for e8m0)."""
        if self.kind == "float":
            return 2.0 ** (1 - self._bias)
        return 1.0 if self.kind == "int" else self.min_value

    @property
    def smallest_positive(self) -> float:
        """The smallest positive value: the smallest subnormal of a float format."""
        if self.kind == "float":
            return 2.0 ** (1 - self._bias - self.mantissa_bits)
        return self.smallest_normal

    @property
    def _bias(self) -> int:
        return (1 << (self.exponent_bits - 1)) - 1


def _float(
    name: str,
    exponent_bits: int,
    mantissa_bits: int,
    max_value: float,
    storage_dtype: str,
    family: str | None = None,
    weight: bool = False,
    activation: bool = False,
    scale: bool = False,
) -> FormatFacts:
    bits = 1 + exponent_bits + mantissa_bits
    return FormatFacts(
        name, "float", bits, True, max_value, -max_value, storage_dtype, exponent_bits, mantissa_bits,
        family, weight, activation, scale,
    )  # fmt: skip


def _int(name: str, bits: int, signed: bool, storage_dtype: str, family: str, activation: bool) -> FormatFacts:
    low, high = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    return FormatFacts(
        name, "int", bits, signed, float(high), float(low), storage_dtype,
        family=family, weight=True, activation=activation,
    )  # fmt: skip


_ROWS: tuple[FormatFacts, ...] = (
    # e2m1 and e4m3fn have no infinity: their largest values are 1.5 * 2**2 and 1.75 * 2**8.
    _float("e2m1", 2, 1, 6.0, "uint8", family="fp4", weight=True, activation=True),
    _float("e4m3", 4, 3, 448.0, "float8_e4m3fn", family="fp8", weight=True, activation=True, scale=True),
    _float("e5m2", 5, 2, (2 - 2.0**-2) * 2.0**15, "float8_e5m2", family="fp8", weight=True, activation=True),
    FormatFacts("e8m0", "scale", 8, False, 2.0**127, 2.0**-127, "uint8", exponent_bits=8, scale=True),
    _int("int2", 2, True, "int8", "int2", activation=False),
    _int("int3", 3, True, "int8", "int3", activation=False),
    _int("int4", 4, True, "int8", "int4", activation=False),
    _int("uint4", 4, False, "uint8", "int4", activation=False),
    _int("int8", 8, True, "int8", "int8", activation=True),
    _int("uint8", 8, False, "uint8", "int8", activation=True),
    _float("fp16", 5, 10, (2 - 2.0**-10) * 2.0**15, "float16", scale=True),
    _float("bf16", 8, 7, (2 - 2.0**-7) * 2.0**127, "bfloat16", scale=True),
    _float("fp32", 8, 23, (2 - 2.0**-23) * 2.0**127, "float32", scale=True),
)

FORMAT_FACTS: Mapping[str, FormatFacts] = MappingProxyType({row.name: row for row in _ROWS})
"""Every element format's facts, by canonical name, in table order."""

FORMAT_ALIASES: Mapping[str, str] = MappingProxyType({"fp4": "e2m1", "fp8": "e4m3", "e4m3fn": "e4m3"})
"""Other spellings accepted by ``qscheme.formats.get_element_format``, mapped to canonical names."""

ANY_FLOAT = "float"
"""The scale format that stands for any 16- or 32-bit float dtype (a descriptor's ``format: float``)."""


def weight_formats() -> tuple[str, ...]:
    """The element formats a descriptor's weight may name, in table order."""
    return tuple(row.name for row in _ROWS if row.weight)


def activation_formats() -> tuple[str, ...]:
    """The element formats a descriptor's activation may name, in table order."""
    return tuple(row.name for row in _ROWS if row.activation)


def float_scale_formats() -> tuple[str, ...]:
    """The 16- and 32-bit float scale formats, in table order (fp16, bf16, fp32)."""
    return tuple(row.name for row in _ROWS if row.scale and not row.coded)


def scale_formats() -> tuple[str, ...]:
    """The formats a scale may name: the coded ones (e4m3, e8m0), then the float ones widest
    first, then ``float`` (any float dtype)."""
    coded = [row for row in _ROWS if row.scale and row.coded]
    floats = sorted((row for row in _ROWS if row.scale and not row.coded), key=lambda row: -row.bits)
    return (*(row.name for row in coded + floats), ANY_FLOAT)


def scale_dtypes(scale_format: str) -> tuple[str, ...]:
    """The dtype names a scale tensor of ``scale_format`` may be stored in."""
    if scale_format == ANY_FLOAT:
        return tuple(FORMAT_FACTS[name].storage_dtype for name in float_scale_formats())
    return (FORMAT_FACTS[scale_format].storage_dtype,)


def is_float_scale(scale_format: str) -> bool:
    """Whether a scale format is a 16- or 32-bit float (or ``float``), loaded as is."""
    return scale_format == ANY_FLOAT or (scale_format in FORMAT_FACTS and not FORMAT_FACTS[scale_format].coded)


def integer_formats() -> tuple[str, ...]:
    """The integer element formats, in table order (int4, uint4, int8, uint8)."""
    return tuple(row.name for row in _ROWS if row.kind == "int")


def range_half(name: str) -> float:
    """``FORMAT_FACTS[name].range_half`` (aliases accepted)."""
    return FORMAT_FACTS[FORMAT_ALIASES.get(name, name)].range_half
