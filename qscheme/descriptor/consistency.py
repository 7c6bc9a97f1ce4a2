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

Pattern = tuple[str, int] | tuple[str, int, int] | int
"""One dimension of an allowed form: (variable, divisor), (variable, divisor, multiplier) for
``K/32*3``, or a constant size."""


def _parts(pattern: tuple[str, int] | tuple[str, int, int]) -> tuple[str, int, int]:
    """(variable, divisor, multiplier) of a variable pattern."""
    return (pattern[0], pattern[1], pattern[2] if len(pattern) == 3 else 1)


@dataclass(frozen=True)
class Form:
    """One allowed shape, e.g. ``[N, K/16]``: it also admits ``[N, ceil(K/16)]``. A dimension with
    a multiplier (``K/32*3``: 3 int32 words per 32 three-bit codes) admits exact division only."""

    dims: tuple[Pattern, ...]

    def admits(self, shape: Shape) -> bool:
        if len(shape) != len(self.dims):
            return False
        for dim, pattern in zip(shape, self.dims, strict=True):
            if isinstance(pattern, int):
                if dim.constant != pattern:
                    return False
            elif (dim.variable, dim.divisor, dim.multiplier) != _parts(pattern):
                return False
        return True

    def render(self, ceil: bool = False) -> str:
        parts = []
        for pattern in self.dims:
            if isinstance(pattern, int):
                parts.append(str(pattern))
            else:
                variable, divisor, multiplier = _parts(pattern)
                text = variable if divisor == 1 else f"{variable}/{divisor}"
                if multiplier != 1:
                    parts.append(f"{text}*{multiplier}")
                else:
                    parts.append(f"ceil({text})" if ceil and divisor != 1 else text)
        return "[" + ", ".join(parts) + "]"

    @property
    def divides(self) -> bool:
        return any(not isinstance(p, int) and _parts(p)[1] != 1 and _parts(p)[2] == 1 for p in self.dims)


SINGLE: tuple[Form, ...] = (Form(()), Form((1,)))
"""One value for the whole tensor: ``[]`` or ``[1]``."""


FOUR_BIT: frozenset[str] = frozenset(name for name, facts in FORMAT_FACTS.items() if facts.bits == 4)
"""The 4-bit element formats (every other weight format is 8-bit)."""


def element_bits(element_format: str) -> int:
    return FORMAT_FACTS[element_format].bits


def packing_ratios(element_format: str, packing: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """(divisor, multiplier) of the weight's rows and of its columns as a packing stores them: a
    stored dimension holds ``size / divisor * multiplier`` entries. int32 packings are a dense bit
    stream along one axis: (8, 1) for 4-bit codes, (32, 3) for 3-bit ones (32 codes in 3 words)."""
    run = FORMAT_FACTS[element_format].int32_run
    table = {
        "none": ((1, 1), (1, 1)),
        "nibbles_k": ((1, 1), (2, 1)),
        "int32_k": ((1, 1), run),
        "int32_n": (run, (1, 1)),
        "int4_n": ((2, 1), (1, 1)),
    }
    return table[packing]


def packing_divisors(element_format: str, packing: str) -> tuple[int, int]:
    """(weight rows per stored row, weight values along K per stored column) of a packing whose
    stored entries each hold whole values (every packing but int32 ones of 3, 5, 6 or 7 bits:
    use ``packing_ratios`` and ``unpacked_sizes`` for those)."""
    (row_divisor, row_multiplier), (column_divisor, column_multiplier) = packing_ratios(element_format, packing)
    return max(1, row_divisor // row_multiplier), max(1, column_divisor // column_multiplier)


def unpacked_sizes(stored: int, ratio: tuple[int, int]) -> range:
    """The sizes a dimension stored packed as ``ratio`` (divisor, multiplier) may have: those
    whose ``ceil(size / divisor * multiplier)`` is ``stored`` (one, or several where a packing
    pads)."""
    divisor, multiplier = ratio
    if stored == 0:
        return range(0, 1)
    return range(max(1, (stored - 1) * divisor // multiplier + 1), stored * divisor // multiplier + 1)


def weight_forms(element_format: str, packing: str) -> tuple[Form, ...]:
    """The stored weight: always 2-D, with the packed dimension divided."""
    rows, columns = packing_ratios(element_format, packing)
    return (Form((_pattern("N", rows), _pattern("K", columns))),)


def _pattern(variable: str, ratio: tuple[int, int]) -> tuple[str, int] | tuple[str, int, int]:
    divisor, multiplier = ratio
    return (variable, divisor) if multiplier == 1 else (variable, divisor, multiplier)


def weight_layout(element_format: str, packing: str) -> str:
    """How a packing stores the weight, in words (for messages)."""
    elements, words = FORMAT_FACTS[element_format].int32_run
    per_int32 = f"{elements} elements per int32" if words == 1 else f"{elements} elements per {words} int32 words"
    table = {
        "none": "one element per value",
        "nibbles_k": "two 4-bit elements per byte along K",
        "int32_k": f"{per_int32} along K",
        "int32_n": f"{per_int32} along N",
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
    """Zero points: one per scale; ``int32_n`` packs them along N (a dense bit stream: ``N/8`` for
    4-bit zero points, ``N/32*3`` for 3-bit ones)."""
    if packing != "int32_n":
        return scales
    elements, words = FORMAT_FACTS[zero_point_format].int32_run

    def packed(pattern: Pattern) -> Pattern:
        if isinstance(pattern, int) or pattern[0] != "N":
            return pattern
        variable, divisor, multiplier = _parts(pattern)
        return _pattern(variable, (divisor * elements, multiplier * words))

    return tuple(Form(tuple(packed(p) for p in form.dims)) for form in scales)


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
