"""Exact numeric formats: element formats with their rounding, and the bit packings.

The facts of each format (bits, range, storage, where a descriptor may name it) are one
torch-free table, ``qscheme.formats.table``; importing this package or that table imports
no torch (the descriptor parser and kernel declarations read the table). The codecs and
packings below need torch and load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qscheme.formats.table import FORMAT_ALIASES, FORMAT_FACTS, FormatFacts

if TYPE_CHECKING:
    from qscheme.formats.elements import (
        E2M1_MAGNITUDES,
        ELEMENT_FORMATS,
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
    "FORMAT_FACTS",
    "ElementFormat",
    "ElementKind",
    "FormatFacts",
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


# Names whose modules import torch, by module: loaded on first use.
_LAZY: dict[str, str] = {
    **dict.fromkeys(
        (
            "E2M1_MAGNITUDES",
            "ELEMENT_FORMATS",
            "ElementFormat",
            "ElementKind",
            "UnknownFormatError",
            "all_codes",
            "decode",
            "encode",
            "get_element_format",
            "mx_scale_exponent",
            "representable_values",
            "round_to_format",
        ),
        "qscheme.formats.elements",
    ),
    **{name: "qscheme.formats.packing" for name in __all__ if "pack" in name},
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'qscheme.formats' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
