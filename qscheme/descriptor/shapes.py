"""Shape expressions of stored tensors, written in terms of N (output) and K (input features).

A dimension is one of: an integer, ``N``, ``K``, ``N/d``, ``K/d`` (exact division: the layer's
size must be divisible), ``ceil(N/d)``, ``ceil(K/d)``, or an exact division times a constant,
``K/d*m`` (the bytes of a row of packed blocks: ``K/32*18`` is 18 bytes per 32 elements), and
``N*K`` in place of N or K (``ceil(N*K/16384)``: one value per 16384 elements of the whole layer,
counted flat, as bitsandbytes' nested absmax).
Nothing else, so that every shape can be evaluated for a layer and also solved for N and K
from a stored tensor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from math import lcm

MAX_SIZE = 2**20
"""Largest constant dimension, divisor, group size or block size a descriptor may declare."""

_DIM = re.compile(
    r"^\s*(?:(?P<int>[0-9]+)|(?P<ceil>ceil\()?\s*(?P<var>N\s*\*\s*K|[NK])\s*(?:/\s*(?P<div>[0-9]+))?\s*(?(ceil)\)|)\s*(?:\*\s*(?P<mul>[0-9]+)\s*)?)$"
)


def _bounded(text: str | int, number: str | int, what: str) -> int:
    """An integer of a dimension (its constant or divisor); ValueError above MAX_SIZE."""
    digits = number.lstrip("0") if isinstance(number, str) else str(number)
    if len(digits) > len(str(MAX_SIZE)) or int(number) > MAX_SIZE:
        shown = repr(text) if len(str(text)) <= 24 else repr(str(text)[:20] + "...")
        raise ValueError(f"{shown}: the {what} is larger than {MAX_SIZE}; use at most {MAX_SIZE}")
    return int(number)


@dataclass(frozen=True)
class Dim:
    """One dimension of a declared shape."""

    text: str
    constant: int | None = None
    variable: str | None = None  # "N", "K" or "N*K" (a flat tensor's element count)
    divisor: int = 1
    ceil: bool = False
    multiplier: int = 1

    @staticmethod
    def parse(text: str | int) -> Dim:
        """Parse ``"K/16"``, ``"ceil(N/128)"``, ``"N"`` or an integer; ValueError otherwise."""
        if isinstance(text, bool):
            raise ValueError(f"{text!r} is not a dimension")
        if isinstance(text, int):
            if text < 0:
                raise ValueError(f"{text!r} is negative")
            return Dim(text=str(text), constant=_bounded(text, text, "size"))
        match = _DIM.match(str(text))
        if match is None:
            raise ValueError(
                f"{text!r} is not a dimension; use an integer, N, K, N/d, K/d, ceil(N/d), ceil(K/d), K/d*m or N*K/d"
            )
        if match.group("int") is not None:
            return Dim(text=str(text), constant=_bounded(text, match.group("int"), "size"))
        divisor = _bounded(text, match.group("div") or "1", "divisor")
        if divisor == 0:
            raise ValueError(f"{text!r} divides by zero")
        ceil = match.group("ceil") is not None
        if ceil and match.group("div") is None:
            raise ValueError(f"{text!r}: ceil() needs a division, e.g. ceil(K/128)")
        multiplier = _bounded(text, match.group("mul") or "1", "multiplier")
        if multiplier == 0 or (multiplier > 1 and (ceil or match.group("div") is None)):
            raise ValueError(f"{text!r}: a multiplier needs an exact division before it and must be >= 1, e.g. K/32*18")
        return Dim(
            text=str(text).replace(" ", ""),
            variable=match.group("var").replace(" ", ""),
            divisor=divisor,
            ceil=ceil,
            multiplier=multiplier,
        )

    def evaluate(self, n: int, k: int) -> int | None:
        """The size for a layer of N x K, or None where N or K is not divisible as declared."""
        if self.constant is not None:
            return self.constant
        size = n if self.variable == "N" else k if self.variable == "K" else n * k
        if self.ceil:
            return -(-size // self.divisor)
        if size % self.divisor:
            return None
        return size // self.divisor * self.multiplier

    def __str__(self) -> str:
        return self.text


Shape = tuple[Dim, ...]


def parse_shape(items: list[str | int]) -> Shape:
    """Parse a list of dimensions."""
    return tuple(Dim.parse(item) for item in items)


def evaluate_shape(shape: Shape, n: int, k: int) -> tuple[int, ...] | None:
    """Evaluate a shape for N x K; None where a dimension does not divide."""
    sizes = [dim.evaluate(n, k) for dim in shape]
    if any(size is None for size in sizes):
        return None
    return tuple(size for size in sizes if size is not None)


def format_shape(shape: Shape) -> str:
    """Render as ``[N, K/16]``."""
    return "[" + ", ".join(str(dim) for dim in shape) + "]"


def shape_multiples(shape: Shape) -> tuple[int, int]:
    """(n_multiple, k_multiple): what N and K must be multiples of for ``shape`` to evaluate.

    Only exact divisions (``K/16``) constrain a layer; ``ceil(K/16)`` stores any K, padded.
    """
    multiples = {"N": 1, "K": 1}
    for dim in shape:
        if dim.variable in multiples and not dim.ceil:
            multiples[dim.variable] = lcm(multiples[dim.variable], dim.divisor)
    return multiples["N"], multiples["K"]


def describe_multiples(n_multiple: int, k_multiple: int) -> str:
    """``N % 2 == 0 and K % 16 == 0`` (a multiple of 1 is left out; ``any N and K`` when both are)."""
    parts = [f"{name} % {multiple} == 0" for name, multiple in (("N", n_multiple), ("K", k_multiple)) if multiple > 1]
    return " and ".join(parts) or "any N and K"
