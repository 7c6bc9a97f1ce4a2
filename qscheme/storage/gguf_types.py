"""The facts of the GGUF container as data: ggml tensor types and metadata value types.

Torch-free and free of the optional ``gguf`` package, so that a GGUF header can be read without
either. The numbers are ggml's (``ggml.h``; gguf-py's ``GGMLQuantizationType`` and
``GGML_QUANT_SIZES``, which ``tests/test_storage_gguf.py`` compares this table with): a tensor of
type T stores ``block_elements`` values of its fastest-varying dimension in ``block_bytes`` bytes.
Ids 4, 5 (Q4_2, Q4_3) and 31 to 33 (Q4_0_4_4 and its kin) were removed from ggml and are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from qscheme.errors import UsageError
from qscheme.text import shown

__all__ = [
    "GGML_TYPES",
    "GGUF_DEFAULT_ALIGNMENT",
    "GGUF_MAX_DIMS",
    "GGUF_MAX_NAME_BYTES",
    "GGUF_SCALAR_TYPES",
    "GGUF_VALUE_TYPES",
    "GGMLType",
    "GGUFScalarType",
    "ggml_type_by_name",
]

GGUF_DEFAULT_ALIGNMENT = 32  # when the file has no general.alignment
GGUF_MAX_DIMS = 4  # ggml tensors have at most four dimensions
GGUF_MAX_NAME_BYTES = 63  # ggml's GGML_MAX_NAME (64) holds the name and its terminating NUL


@dataclass(frozen=True)
class GGMLType:
    """One ggml tensor type: ``block_elements`` values of dims[0] stored in ``block_bytes`` bytes."""

    id: int
    name: str
    block_elements: int
    block_bytes: int

    def row_bytes(self, elements: int) -> int:
        """Bytes of a run of ``elements`` values (a multiple of ``block_elements``)."""
        return elements // self.block_elements * self.block_bytes


GGML_TYPES: Mapping[int, GGMLType] = MappingProxyType(
    {
        row[0]: GGMLType(*row)
        for row in (
            (0, "F32", 1, 4),
            (1, "F16", 1, 2),
            (2, "Q4_0", 32, 18),
            (3, "Q4_1", 32, 20),
            (6, "Q5_0", 32, 22),
            (7, "Q5_1", 32, 24),
            (8, "Q8_0", 32, 34),
            (9, "Q8_1", 32, 40),
            (10, "Q2_K", 256, 84),
            (11, "Q3_K", 256, 110),
            (12, "Q4_K", 256, 144),
            (13, "Q5_K", 256, 176),
            (14, "Q6_K", 256, 210),
            (15, "Q8_K", 256, 292),
            (16, "IQ2_XXS", 256, 66),
            (17, "IQ2_XS", 256, 74),
            (18, "IQ3_XXS", 256, 98),
            (19, "IQ1_S", 256, 50),
            (20, "IQ4_NL", 32, 18),
            (21, "IQ3_S", 256, 110),
            (22, "IQ2_S", 256, 82),
            (23, "IQ4_XS", 256, 136),
            (24, "I8", 1, 1),
            (25, "I16", 1, 2),
            (26, "I32", 1, 4),
            (27, "I64", 1, 8),
            (28, "F64", 1, 8),
            (29, "IQ1_M", 256, 56),
            (30, "BF16", 1, 2),
            (34, "TQ1_0", 256, 54),
            (35, "TQ2_0", 256, 66),
            (39, "MXFP4", 32, 17),
            (40, "NVFP4", 64, 36),
            (41, "Q1_0", 128, 18),
        )
    }
)
_BY_NAME: Mapping[str, GGMLType] = MappingProxyType({t.name: t for t in GGML_TYPES.values()})


def ggml_type_by_name(name: str) -> GGMLType:
    """The ggml type called ``name`` (e.g. ``"Q4_K"``); UsageError listing the known names if none is."""
    found = _BY_NAME.get(name) if isinstance(name, str) else None
    if found is None:
        raise UsageError(
            f"unknown ggml tensor type {shown(repr(name), 80)}; known types: {', '.join(_BY_NAME)} "
            "(names as ggml spells them)"
        )
    return found


@dataclass(frozen=True)
class GGUFScalarType:
    """A metadata value type of fixed size: its id, name (gguf-py's), byte width and struct code."""

    id: int
    name: str
    size: int
    code: str  # struct format character, little-endian


GGUF_SCALAR_TYPES: Mapping[str, GGUFScalarType] = MappingProxyType(
    {
        row[1]: GGUFScalarType(*row)
        for row in (
            (0, "UINT8", 1, "B"),
            (1, "INT8", 1, "b"),
            (2, "UINT16", 2, "H"),
            (3, "INT16", 2, "h"),
            (4, "UINT32", 4, "I"),
            (5, "INT32", 4, "i"),
            (6, "FLOAT32", 4, "f"),
            (7, "BOOL", 1, "B"),  # one byte, 0 or 1
            (10, "UINT64", 8, "Q"),
            (11, "INT64", 8, "q"),
            (12, "FLOAT64", 8, "d"),
        )
    }
)
STRING_TYPE_ID = 8
ARRAY_TYPE_ID = 9
# Every value type by id: the scalars, STRING (u64 length + UTF-8 bytes) and ARRAY (u32 element
# type, u64 count, the elements).
GGUF_VALUE_TYPES: Mapping[int, str] = MappingProxyType(
    dict(sorted({**{t.id: t.name for t in GGUF_SCALAR_TYPES.values()}, 8: "STRING", 9: "ARRAY"}.items()))
)
GGUF_VALUE_TYPE_IDS: Mapping[str, int] = MappingProxyType({name: id for id, name in GGUF_VALUE_TYPES.items()})
