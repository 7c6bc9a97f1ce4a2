"""The shapes a declared tensor may have, given the packing and scale granularity around it.

A descriptor declares each tensor's shape and, separately, how the weight is packed and how
its scales are laid out. The two must agree: a ``nibbles_k`` weight is ``[N, K/2]``, a group
scale with ``group_size: 32`` is ``[N, K/32]``. The forms allowed here are the ones the
built-in schemes declare; a divided dimension may also be written with ``ceil(...)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from qscheme.descriptor.shapes import Shape
from qscheme.formats.table import FORMAT_FACTS

Pattern = tuple[str, int] | int
"""One dimension of an allowed form: (variable, divisor), or a constant size."""


@dataclass(frozen=True)
class Form:
    """One allowed shape, e.g. ``[N, K/16]``: it also admits ``[N, ceil(K/16)]``."""

    dims: tuple[Pattern, ...]

    def admits(self, shape: Shape) -> bool:
        if len(shape) != len(self.dims):
            return False
        for dim, pattern in zip(shape, self.dims, strict=True):
            if isinstance(pattern, int):
                if dim.constant != pattern:
                    return False
            elif (dim.variable, dim.divisor) != pattern:
                return False
        return True

    def render(self, ceil: bool = False) -> str:
        parts = []
        for pattern in self.dims:
            if isinstance(pattern, int):
                parts.append(str(pattern))
            else:
                variable, divisor = pattern
                text = variable if divisor == 1 else f"{variable}/{divisor}"
                parts.append(f"ceil({text})" if ceil and divisor != 1 else text)
        return "[" + ", ".join(parts) + "]"

    @property
    def divides(self) -> bool:
        return any(not isinstance(p, int) and p[1] != 1 for p in self.dims)


SINGLE: tuple[Form, ...] = (Form(()), Form((1,)))
"""One value for the whole tensor: ``[]`` or ``[1]``."""


FOUR_BIT: frozenset[str] = frozenset(name for name, facts in FORMAT_FACTS.items() if facts.bits == 4)
"""The 4-bit element formats (every other weight format is 8-bit)."""


def element_bits(element_format: str) -> int:
    return FORMAT_FACTS[element_format].bits


def packing_divisors(element_format: str, packing: str) -> tuple[int, int]:
    """(weight rows per stored row, weight values along K per stored column) of a packing."""
    table = {
        "none": (1, 1),
        "nibbles_k": (1, 2),
        "int32_k": (1, FORMAT_FACTS[element_format].per_int32),
        "int32_n": (FORMAT_FACTS[element_format].per_int32, 1),
        "int4_n": (2, 1),
    }
    return table[packing]


def weight_forms(element_format: str, packing: str) -> tuple[Form, ...]:
    """The stored weight: always 2-D, with the packed dimension divided."""
    per_row, per_column = packing_divisors(element_format, packing)
    return (Form((("N", per_row), ("K", per_column))),)


def weight_layout(element_format: str, packing: str) -> str:
    """How a packing stores the weight, in words (for messages)."""
    per_int32 = packing_divisors(element_format, "int32_k")[1]
    table = {
        "none": "one element per value",
        "nibbles_k": "two 4-bit elements per byte along K",
        "int32_k": f"{per_int32} elements per int32 along K",
        "int32_n": f"{per_int32} elements per int32 along N",
        "int4_n": "two int4 rows per byte along N",
    }
    return table[packing]


def scale_forms(granularity: str, group_size: int | None, block: tuple[int, int] | None) -> tuple[Form, ...]:
    """The weight scale for each granularity (empty when its size is not known)."""
    if granularity == "tensor":
        return SINGLE
    if granularity == "channel":
        return (Form((("N", 1), 1)), Form((("N", 1),)))
    if granularity == "group" and group_size is not None:
        return (Form((("N", 1), ("K", group_size))),)
    if granularity == "block" and block is not None:
        rows, columns = block
        return (Form((("N", rows), ("K", columns))), Form((("N", rows), 1, ("K", columns), 1)))
    return ()


def scale_layout(granularity: str, group_size: int | None, block: tuple[int, int] | None) -> str:
    if granularity == "group":
        return f"granularity 'group' with group_size {group_size} (one scale per {group_size} elements along K)"
    if granularity == "block" and block is not None:
        return f"granularity 'block' with block {list(block)} (one scale per {block[0]} x {block[1]} block)"
    if granularity == "channel":
        return "granularity 'channel' (one scale per output row)"
    return "granularity 'tensor' (one scale for the whole weight)"


def zero_point_forms(scales: tuple[Form, ...], packing: str, zero_point_format: str) -> tuple[Form, ...]:
    """Zero points: one per scale; ``int32_n`` packs them along N."""
    if packing != "int32_n":
        return scales
    per_int32 = FORMAT_FACTS[zero_point_format].per_int32
    return tuple(
        Form(tuple((p[0], p[1] * per_int32) if not isinstance(p, int) and p[0] == "N" else p for p in form.dims))
        for form in scales
    )


def transposed_forms(forms: tuple[Form, ...]) -> tuple[Form, ...]:
    """The forms of a tensor stored transposed (``transposed: true``): each 2-D form reversed."""
    return tuple(Form(tuple(reversed(form.dims))) if len(form.dims) == 2 else form for form in forms)


def describe(forms: tuple[Form, ...]) -> str:
    """``[N, K/32] (or [N, ceil(K/32)])`` for each form, joined with ``or``."""
    out = []
    for form in forms:
        text = form.render()
        if form.divides:
            text += f" (or {form.render(ceil=True)})"
        out.append(text)
    return " or ".join(out)
