"""How far a conversion moves a layer's dequantized weight: the largest deviation in float32 ulps.

Both sides are dequantized exactly as ``qscheme.canonical.dequantize`` does (decoded element,
minus the zero point, times the effective scale, one float32 rounding) and compared element by
element. ``ulps`` counts the float32 values between the two results (0 when bit-identical; +0
and -0 are the same value). The work goes slab by slab of rows, so that memory stays a small
multiple of one slab, and skips every slab whose effective scales are bit-identical on both
sides when the codes and zero points are too: its dequantized values are then equal by
construction.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from qscheme.canonical import CanonicalWeight, effective_scale, element_values, expand_tiles, scale_tile

SLAB_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class Deviation:
    """The largest difference between two dequantized weights."""

    max_ulps: int
    max_abs_error: float

    @staticmethod
    def none() -> Deviation:
        return Deviation(0, 0.0)


def ordered_bits(values: Tensor) -> Tensor:
    """float32 values -> int64 keys whose differences count the float32 values between them."""
    bits = values.contiguous().view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def ulp_distance(a: Tensor, b: Tensor) -> Tensor:
    """Elementwise number of float32 steps between ``a`` and ``b`` (int64)."""
    return (ordered_bits(a.to(torch.float32)) - ordered_bits(b.to(torch.float32))).abs()


def compare_dequantized(a: Tensor, b: Tensor) -> Deviation:
    """The deviation between two float32 weights of one shape."""
    if a.numel() == 0:
        return Deviation.none()
    return Deviation(int(ulp_distance(a, b).max()), float((a - b).abs().max()))


def _rows_of(weight: CanonicalWeight, scale: Tensor, rows: slice) -> Tensor:
    """The effective scale over weight rows ``rows``, as [rows, K] or broadcastable to it."""
    return expand_tiles(scale, scale_tile(weight, scale), rows, weight.k)


def _values(weight: CanonicalWeight, rows: slice) -> Tensor:
    part = replace(weight, codes=weight.codes[rows], n=rows.stop - rows.start, partitions=(rows.stop - rows.start,))
    values = element_values(part)
    if weight.zero_point is not None:
        tile = scale_tile(weight, weight.scale)
        values = values - expand_tiles(weight.zero_point.to(torch.float32), tile, rows, weight.k)
    return values


def _full_scale(weight: CanonicalWeight) -> Tensor:
    scale = effective_scale(weight)
    if weight.scheme.weight.scale.granularity == "tensor" and scale.numel() == 1:
        scale = scale.reshape(1, 1).expand(weight.n, 1)
    return scale


def _same(a: Tensor | None, b: Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.itemsize == 1:  # float8 has no torch.equal on CPU: compare the bytes
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return bool(torch.equal(a, b))


def weight_deviation(source: CanonicalWeight, target: CanonicalWeight) -> Deviation:
    """The largest deviation between the two layers' dequantized weights (same N x K)."""
    if (source.n, source.k) != (target.n, target.k):
        raise ValueError(f"layers of different shapes: {source.n}x{source.k} and {target.n}x{target.k}")
    n, k = source.n, source.k
    shared = (
        source.scheme.weight.format == target.scheme.weight.format
        and _same(source.codes, target.codes)
        and _same(source.zero_point, target.zero_point)
    )
    scale_a, scale_b = _full_scale(source), _full_scale(target)
    same_tiles = scale_tile(source, scale_a) == scale_tile(target, scale_b)
    if shared and same_tiles and _same(scale_a, scale_b):
        return Deviation.none()
    tile_rows = max(scale_tile(source, scale_a)[0], scale_tile(target, scale_b)[0])
    step = max(1, SLAB_ELEMENTS // max(1, k) // tile_rows) * tile_rows
    worst_ulps, worst_abs = 0, 0.0
    for start in range(0, n, step):
        rows = slice(start, min(n, start + step))
        part_a, part_b = _rows_of(source, scale_a, rows), _rows_of(target, scale_b, rows)
        if shared and same_tiles and torch.equal(part_a, part_b):
            continue
        values_a = _values(source, rows)
        values_b = values_a if shared else _values(target, rows)
        deviation = compare_dequantized(values_a * part_a, values_b * part_b)
        worst_ulps = max(worst_ulps, deviation.max_ulps)
        worst_abs = max(worst_abs, deviation.max_abs_error)
    return Deviation(worst_ulps, worst_abs)
