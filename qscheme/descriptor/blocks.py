"""Packed blocks: a weight stored as an array of fixed-size structs, declared as data.

Some producers (llama.cpp's GGUF types, for one) store a weight row as a run of blocks, each a
few bytes holding a block's scales, minimums and element codes side by side. A descriptor
declares such a block with ``packing: blocks`` and a ``blocks:`` section:

- ``elements`` and ``bytes``: how many weights one block holds and its size;
- ``fields``: the block's byte ranges in order, each either floats (``format: fp16`` with an
  optional ``count``) or raw bytes (``bytes: 12``);
- ``integers``: small unsigned (or ``signed``) integers unpacked from the raw fields, low bits
  first, by ``planes`` (a regular bit plane: ``bits`` per value; within each run of ``run``
  bytes, bit group f of byte j holds value ``f * run + j`` of that run, so ``run: 1`` is the
  adjacent order and ``run: 16`` llama.cpp's "low nibbles first, then high nibbles") or by
  ``pieces`` (an explicit table: value i is assembled from ``[byte, first_bit, width]`` pieces,
  low bits first), with an ``offset`` added after assembly;
- ``element``: the value of each weight's code: an integer as it is, through a lookup
  ``table`` (a codebook) or decoded as an element ``format`` (e2m1); absent, the weight is the
  scale product itself (a plain float block);
- ``scale``: a product of factors, floats fields and integers, multiplied left to right in
  float32; a factor with ``c`` values per block covers ``elements / c`` consecutive weights
  (quantized inner scales are integer factors after a float super-block scale);
- ``minimum`` (optional): ``{subtract: [...]}`` or ``{add: [...]}``, another product applied
  after the scale: ``weight = scale * element - minimum``.

This module holds the parsed form and its checks (torch-free); the decoder that runs it is
``qscheme.formats.blocks``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from qscheme.formats.table import FORMAT_FACTS

FIELD_FORMATS: tuple[str, ...] = ("fp16", "bf16", "fp32", "e8m0", "e4m3", "ue4m3")
"""The formats a float field of a block may have (one value of 2, 4 or 1 bytes each)."""

MAX_BLOCK_BYTES = 4096
"""Largest block a descriptor may declare (llama.cpp's largest is a few hundred bytes)."""

MAX_BLOCK_ELEMENTS = 4096


@dataclass(frozen=True)
class BlockField:
    """A byte range of a block: ``count`` floats of ``format``, or raw bytes (format None)."""

    name: str
    offset: int
    size: int
    format: str | None = None
    count: int = 1


@dataclass(frozen=True)
class Plane:
    """A regular bit plane of a raw field: see the module docstring."""

    field: str
    bits: int
    run: int = 1
    first_byte: int = 0


@dataclass(frozen=True)
class Piece:
    """Bits ``[shift, shift + width)`` of byte ``byte`` of a raw field."""

    byte: int
    shift: int
    width: int


@dataclass(frozen=True)
class IntegerSpec:
    """``count`` integers per block, assembled low bits first from planes or a piece table.

    ``sources`` holds, per value, its pieces as (field, byte within the field, shift, width);
    planes are expanded into it at parse time, so that every value has one form; ``planes`` keeps
    the planes too (empty for a piece table), which the decoder unpacks without gathers.
    """

    name: str
    count: int
    bits: int
    signed: bool
    offset: int
    sources: tuple[tuple[tuple[str, int, int, int], ...], ...]
    planes: tuple[Plane, ...] = ()


@dataclass(frozen=True)
class ElementRule:
    """How a weight's code becomes its value: as is, by a table, or by an element format."""

    integer: str
    table: tuple[float, ...] | None = None
    format: str | None = None


MinimumSign = Literal["add", "subtract"]


@dataclass(frozen=True)
class BlockLayout:
    """A block's declaration (see the module docstring)."""

    elements: int
    bytes: int
    fields: tuple[BlockField, ...]
    integers: tuple[IntegerSpec, ...]
    element: ElementRule | None
    scale: tuple[str, ...]
    minimum: tuple[str, ...] = ()
    minimum_sign: MinimumSign = "subtract"

    def field(self, name: str) -> BlockField | None:
        return next((f for f in self.fields if f.name == name), None)

    def integer(self, name: str) -> IntegerSpec | None:
        return next((i for i in self.integers if i.name == name), None)

    def count_of(self, factor: str) -> int:
        """Values per block of a scale or minimum factor (a float field or an integer)."""
        field = self.field(factor)
        if field is not None:
            return field.count
        integer = self.integer(factor)
        assert integer is not None, factor
        return integer.count

    @property
    def sub_block(self) -> int:
        """Weights under one value of the finest scale or minimum factor."""
        finest = max((self.count_of(name) for name in self.scale + self.minimum), default=1)
        return self.elements // finest

    @property
    def code_kind(self) -> str:
        """What a weight's code is, in the words kernel declarations use (``Supports.block_codes``):
        ``uint<b>`` / ``int<b>`` for a b-bit integer code used as a number (the weight is then
        affine in it: scale * (code + offset) plus or minus the minimum), ``table<b>`` for a
        lookup table, an element format's name (``e2m1``), or ``float`` for a plain float block."""
        if self.element is None:
            return "float"
        integer = self.integer(self.element.integer)
        assert integer is not None
        if self.element.table is not None:
            return f"table{integer.bits}"
        if self.element.format is not None:
            return self.element.format
        return f"{'int' if integer.signed else 'uint'}{integer.bits}"

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.bytes / self.elements

    def describe(self) -> str:
        """``blocks of 256 in 144 bytes (4.5 bits per weight): d * sc * q - dmin * m``."""

        def shown(name: str) -> str:
            integer = self.integer(name)
            if integer is None or not integer.offset:
                return name
            return f"({name} {'-' if integer.offset < 0 else '+'} {abs(integer.offset)})"

        element = "1" if self.element is None else shown(self.element.integer)
        if self.element is not None and self.element.table is not None:
            element = f"table[{element}]"
        elif self.element is not None and self.element.format is not None:
            element = f"{self.element.format}({element})"
        factors = [shown(name) for name in self.scale]
        formula = " * ".join((*factors, element)) if self.element is not None else " * ".join(factors)
        if self.minimum:
            sign = "-" if self.minimum_sign == "subtract" else "+"
            formula += f" {sign} " + " * ".join(shown(name) for name in self.minimum)
        return f"blocks of {self.elements} in {self.bytes} bytes ({self.bits_per_weight:g} bits per weight): {formula}"


def field_value_bytes(field_format: str) -> int:
    """Bytes of one value of a float field's format."""
    if field_format == "ue4m3":
        return 1
    return FORMAT_FACTS[field_format].bits // 8


def plane_sources(plane: Plane, count: int, field_size: int) -> list[tuple[str, int, int, int]] | str:
    """The (field, byte, shift, width) of each of ``count`` values of a plane, or why it does not fit."""
    if 8 % plane.bits:
        return f"bits {plane.bits} do not divide a byte; use 1, 2, 4 or 8 (or pieces for other widths)"
    per_byte = 8 // plane.bits
    per_run = plane.run * per_byte
    if count % per_run:
        return f"{count} values are not whole runs of {plane.run} bytes x {per_byte} values ({per_run} values)"
    needed = plane.first_byte + count // per_byte
    if needed > field_size:
        return f"the plane needs bytes [{plane.first_byte}, {needed}) of a {field_size}-byte field"
    out = []
    for value in range(count):
        run, within = divmod(value, per_run)
        group, byte = divmod(within, plane.run)
        out.append((plane.field, plane.first_byte + run * plane.run + byte, group * plane.bits, plane.bits))
    return out
