"""Exact numeric formats: element formats with their rounding, and the bit packings."""

from __future__ import annotations

from qscheme.formats.elements import (
    E2M1_MAGNITUDES,
    ELEMENT_FORMATS,
    FORMAT_ALIASES,
    ElementFormat,
    ElementKind,
    UnknownFormatError,
    all_codes,
    decode,
    encode,
    get_element_format,
    mx_scale_exponent,
    representable_values,
    round_to_format,
)
from qscheme.formats.packing import (
    pack_fp4_k,
    pack_int4_n,
    pack_int32_k,
    pack_int32_n,
    pack_nibbles_k,
    unpack_fp4_k,
    unpack_int4_n,
    unpack_int32_k,
    unpack_int32_n,
    unpack_nibbles_k,
)

__all__ = [
    "E2M1_MAGNITUDES",
    "ELEMENT_FORMATS",
    "FORMAT_ALIASES",
    "ElementFormat",
    "ElementKind",
    "UnknownFormatError",
    "all_codes",
    "decode",
    "encode",
    "get_element_format",
    "mx_scale_exponent",
    "pack_fp4_k",
    "pack_int4_n",
    "pack_int32_k",
    "pack_int32_n",
    "pack_nibbles_k",
    "representable_values",
    "round_to_format",
    "unpack_fp4_k",
    "unpack_int4_n",
    "unpack_int32_k",
    "unpack_int32_n",
    "unpack_nibbles_k",
]
