"""Where each scale of a weight applies, and the min/max statistics of those regions.

A weight is [N, K]. A scale layout ties every element to one scale; scales are laid out as
[scale rows, scale columns]:

- ``tensor``: one scale, [1, 1].
- ``channel``: one scale per output row, [N, 1].
- ``group``: one scale per ``group_size`` consecutive elements along K, [N, ceil(K/G)].
- ``block``: one scale per ``rows x columns`` tile, [ceil(N/R), ceil(K/C)].

Incomplete groups and edge blocks are padded with zeros, as compressed-tensors does for its
block scales and ModelOpt for its block quantizers. A zero never changes a region's scale here,
because every rule widens the observed range to include zero before using it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional

from qscheme.descriptor import ScaleSpec
from qscheme.errors import QuantizeError
from qscheme.slabs import run_slabs, slabs_for


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ScaleLayout:
    """How the scales of one granularity tile an N x K weight."""

    granularity: str
    n: int
    k: int
    tile_rows: int  # weight rows under one scale row (1 for tensor: its single scale broadcasts)
    tile_columns: int  # weight columns under one scale column

    @staticmethod
    def of(spec: ScaleSpec, n: int, k: int) -> ScaleLayout:
        """The layout a scale spec gives an N x K weight."""
        if spec.granularity == "tensor":
            return ScaleLayout("tensor", n, k, 1, k)
        if spec.granularity == "channel":
            return ScaleLayout("channel", n, k, 1, k)
        if spec.granularity == "group":
            if spec.group_size is None:
                raise QuantizeError("a group scale needs group_size")
            return ScaleLayout("group", n, k, 1, spec.group_size)
        if spec.block is None:
            raise QuantizeError("a block scale needs block: [rows, columns]")
        return ScaleLayout("block", n, k, spec.block[0], spec.block[1])

    @property
    def scale_shape(self) -> tuple[int, int]:
        if self.granularity == "tensor":
            return (1, 1)
        return (ceil_div(self.n, self.tile_rows), ceil_div(self.k, self.tile_columns))

    @property
    def padded_n(self) -> int:
        return ceil_div(self.n, self.tile_rows) * self.tile_rows

    @property
    def padded_k(self) -> int:
        return ceil_div(self.k, self.tile_columns) * self.tile_columns

    def pad(self, weight: Tensor) -> Tensor:
        """The weight zero-padded to whole tiles (the weight itself when nothing is missing)."""
        missing_rows, missing_columns = self.padded_n - self.n, self.padded_k - self.k
        if missing_rows == 0 and missing_columns == 0:
            return weight
        return functional.pad(weight, (0, missing_columns, 0, missing_rows))

    def tiles(self, padded_rows: Tensor) -> Tensor:
        """Padded weight rows as [tile rows, rows per tile, scale columns, columns per tile]."""
        columns = 1 if self.granularity == "tensor" else self.padded_k // self.tile_columns
        return padded_rows.view(-1, self.tile_rows, columns, self.tile_columns)

    def scale_tiles(self, scale: Tensor, rows: slice) -> Tensor:
        """The scales of weight rows ``rows``, shaped to broadcast over ``tiles`` of them.

        A tensor scale is returned as given, so that its number of dimensions (a 0-dim tensor
        does not promote the weight's dtype; a [1] tensor does) reaches the arithmetic intact.
        """
        if self.granularity == "tensor":
            return scale
        start, stop = rows.start // self.tile_rows, ceil_div(rows.stop, self.tile_rows)
        return scale.reshape(self.scale_shape)[start:stop].unsqueeze(1).unsqueeze(-1)

    def untile(self, tiles: Tensor) -> Tensor:
        """Inverse of ``tiles``: [rows, padded K]."""
        return tiles.reshape(-1, self.padded_k)


def _region_min_max(rows: Tensor, layout: ScaleLayout) -> tuple[Tensor, Tensor]:
    """float32 min and max of every region of whole tile rows, [scale rows, scale columns]."""
    values = rows.to(torch.float32)  # exact; reductions are fastest in float32 (may be ``rows`` itself)
    if layout.tile_rows == 1 and layout.tile_columns <= 64:
        # short groups: max pooling beats a reduction over a short last dimension many times over
        windows = values.unsqueeze(0)
        maximum = functional.max_pool1d(windows, layout.tile_columns)
        minimum = functional.max_pool1d(torch.neg(windows), layout.tile_columns).neg_()
        return minimum[0], maximum[0]
    regions = layout.tiles(values).transpose(1, 2).flatten(2)  # [scale rows, scale columns, R*C]
    return torch.aminmax(regions, dim=-1)


def _region_absmax(rows: Tensor, layout: ScaleLayout) -> Tensor:
    """float32 max |x| of every region of whole tile rows, [scale rows, scale columns]."""
    magnitudes = torch.abs(rows.to(torch.float32))
    if layout.tile_rows == 1 and layout.tile_columns <= 64:
        return functional.max_pool1d(magnitudes.unsqueeze(0), layout.tile_columns)[0]
    return layout.tiles(magnitudes).transpose(1, 2).flatten(2).amax(dim=-1)


def observe_absmax(padded: Tensor, layout: ScaleLayout) -> Tensor:
    """max |x| of every scale region, [scale rows, scale columns], in the weight's dtype (exact;
    NaN propagates). Equal to max(|min|, |max|) of ``observe_min_max``, in one pass fewer."""
    if layout.granularity == "tensor":
        return padded.abs().amax().reshape(1, 1)
    absmax = torch.empty(layout.scale_shape, dtype=padded.dtype, device=padded.device)

    def work(rows: slice) -> None:
        absmax[rows.start // layout.tile_rows : rows.stop // layout.tile_rows] = _region_absmax(padded[rows], layout)

    run_slabs(work, slabs_for(padded.device, layout.padded_n, layout.padded_k, layout.tile_rows), padded.device)
    return absmax


def observe_min_max(padded: Tensor, layout: ScaleLayout) -> tuple[Tensor, Tensor]:
    """The minimum and maximum of every scale region, [scale rows, scale columns], in the
    weight's dtype (both are exact in any dtype; NaN propagates)."""
    if layout.granularity == "tensor":
        minimum, maximum = torch.aminmax(padded)
        return minimum.reshape(1, 1), maximum.reshape(1, 1)
    minimum = torch.empty(layout.scale_shape, dtype=padded.dtype, device=padded.device)
    maximum = torch.empty_like(minimum)

    def work(rows: slice) -> None:
        scale_rows = slice(rows.start // layout.tile_rows, rows.stop // layout.tile_rows)
        low, high = _region_min_max(padded[rows], layout)
        minimum[scale_rows] = low
        maximum[scale_rows] = high

    slabs = slabs_for(padded.device, layout.padded_n, layout.padded_k, layout.tile_rows)
    run_slabs(work, slabs, padded.device)
    return minimum, maximum
