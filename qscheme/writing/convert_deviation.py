"""How far a conversion moves a layer's dequantized weight: the largest deviation in float32 ulps.

The figure is exact over the weights actually present: for every element, both sides'
dequantized values are those ``qscheme.canonical.dequantize`` computes (decoded element, minus
the zero point, times the effective scale, one float32 rounding), and ``max_ulps`` /
``max_abs_error`` are the largest differences over all N x K elements. ``ulps`` counts the
float32 values between the two results (0 when bit-identical; +0 and -0 are the same value).

Two ways to get it, with the same result:

- ``weight_deviation`` (the fast path, taken whenever both sides hold the same codes and zero
  points with scales in the same tile layout, which is every exact conversion): an element's
  deviation depends only on its code and on its tile's (scale a, scale b, zero point) triple,
  both drawn from small sets. So the distinct triples are numbered once over the tiles (N x K /
  group values, not N x K) and the deviation of every (triple, code) pair is evaluated with the
  very float32 arithmetic of the dequantization (a table of triples x 16 or 256 codes). What
  remains is which pairs occur. The pairs are tried from the largest deviation down: the tiles
  of the pair's triple are gathered and their code bytes looked up, and the first pair found
  present gives the figure (in practice the first one tried: each triple covers many tiles,
  and every code occurs in them). Before that, a sample of tiles spread over the layer is
  looked at for all of the level's pairs at once, which settles most layers in one small
  step. Should the search gather more code bytes than the layer holds, or the tiles not be
  whole rows of bytes, one integer pass over all code bytes counts
  the (triple, byte) keys instead (``torch.bincount``). Either way the figure is the exact
  maximum over the elements present, not a bound.
- ``full_deviation`` (the reference, and the fallback for layers whose codes differ): both sides
  dequantized slab by slab of rows and compared element by element.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from qscheme.canonical import CanonicalWeight, effective_scale, element_values, expand_tiles, scale_tile
from qscheme.descriptor.consistency import FOUR_BIT

SLAB_ELEMENTS = 1 << 20
COUNT_SLAB_BYTES = 1 << 24  # code bytes keyed per bincount call (int32 keys: 64 MB)


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


def _check_shapes(source: CanonicalWeight, target: CanonicalWeight) -> None:
    if (source.n, source.k) != (target.n, target.k):
        raise ValueError(f"layers of different shapes: {source.n}x{source.k} and {target.n}x{target.k}")


def weight_deviation(source: CanonicalWeight, target: CanonicalWeight) -> Deviation:
    """The largest deviation between the two layers' dequantized weights (same N x K), exact over
    the elements present: the fast path of the module docstring when the codes are shared, else
    ``full_deviation``."""
    _check_shapes(source, target)
    if source.n * source.k == 0:
        return Deviation.none()
    shared = (
        source.scheme.weight.format == target.scheme.weight.format
        and _same(source.codes, target.codes)
        and _same(source.zero_point, target.zero_point)
    )
    if not shared:
        return full_deviation(source, target)
    tile = scale_tile(source, source.scale)
    tables = _byte_scale_tables(source, target, tile)
    if tables is None:
        scale_a, scale_b = _full_scale(source), _full_scale(target)
        if tile != scale_tile(target, scale_b) or scale_a.shape != scale_b.shape:
            return full_deviation(source, target)
        if _same(scale_a, scale_b):
            return Deviation.none()
        zero = source.zero_point
        if zero is not None and zero.shape != scale_a.shape:
            return full_deviation(source, target)
        tables = _tables(source, scale_a.contiguous(), scale_b.contiguous(), zero)
        if tables is None:
            return full_deviation(source, target)
    return _counted_deviation(source, tables, tile)


def full_deviation(source: CanonicalWeight, target: CanonicalWeight) -> Deviation:
    """The same figure as ``weight_deviation``, from both sides dequantized in full (slab by slab)."""
    _check_shapes(source, target)
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


# --- the fast path: (triple, code) tables, then which pairs occur -------------------------------------

TABLE_LIMIT = 1 << 22  # triples x codes beyond which the full comparison is used (memory)
SAMPLE_TILES = 256  # tiles looked at first, spread over the layer, for the pairs of a level


@dataclass(frozen=True)
class _Tables:
    index: Tensor  # int32, the triple of every tile, in the tiles' layout
    tiles: Tensor  # int64 [T]: how many tiles each triple has
    ulps: Tensor  # int64 [T, C]: deviation in ulps of code c under triple t
    abs_error: Tensor  # float32 [T, C]


@dataclass(frozen=True)
class _Units:
    codes: Tensor  # uint8 [N, U]: code units, each inside one tile
    per_unit: int  # elements per unit: 2 (a byte of two 4-bit codes) or 1
    holds: Tensor  # bool [256, C]: which element codes a unit value holds


def _triples(scale_a: Tensor, scale_b: Tensor, zero: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Number the tiles' distinct (scale a, scale b, zero point) triples: (int32 index per tile in
    the tiles' layout, tiles per triple, [T, 3] float32 columns scale a, scale b, zero point)."""
    bits_a = scale_a.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    bits_b = scale_b.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    pairs, index, counts = torch.unique((bits_a << 32) | bits_b, return_inverse=True, return_counts=True)
    first_a = (pairs >> 32).to(torch.int32).view(torch.float32)
    first_b = (pairs & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    zeros = torch.zeros_like(first_a)
    if zero is not None:
        keyed, index, counts = torch.unique(
            index * 65536 + (zero.to(torch.int64) + 32768), return_inverse=True, return_counts=True
        )
        pair_of = keyed // 65536
        first_a, first_b = first_a[pair_of], first_b[pair_of]
        zeros = (keyed % 65536 - 32768).to(torch.float32)
    return index.to(torch.int32), counts, torch.stack((first_a, first_b, zeros), dim=1)


def _code_values(weight: CanonicalWeight) -> Tensor:
    """The decoded value of every element code as float32 [C] (16 codes of 4 bits or 256 of 8),
    by the same decoding as the dequantization (``element_values``)."""
    if weight.scheme.weight.format in FOUR_BIT:
        codes, count = torch.arange(16, dtype=torch.uint8), 16
    else:
        codes, count = torch.arange(256, dtype=torch.uint8).view(weight.codes.dtype), 256
    fake = replace(weight, codes=codes.reshape(count, 1), n=count, k=1, partitions=(count,), zero_point=None)
    return element_values(fake).reshape(count)


def _code_units(weight: CanonicalWeight, tile_columns: int) -> _Units:
    """The codes as units each inside one tile: bytes of two 4-bit codes when every tile is a whole
    number of bytes, else 4-bit codes unpacked one per byte; 8-bit codes as their bytes."""
    codes = weight.codes
    units = torch.arange(256)
    if weight.scheme.weight.format not in FOUR_BIT:
        return _Units(codes.view(torch.uint8), 1, torch.eye(256, dtype=torch.bool))
    nibble = torch.arange(16)
    if weight.k % 2 == 0 and tile_columns % 2 == 0:
        holds = ((units & 0xF).unsqueeze(1) == nibble) | ((units >> 4).unsqueeze(1) == nibble)
        return _Units(codes.view(torch.uint8), 2, holds)
    unpacked = torch.stack((codes & 0xF, codes >> 4), dim=-1).reshape(codes.shape[0], -1)
    return _Units(unpacked[:, : weight.k].contiguous(), 1, units.unsqueeze(1) == nibble)


def _table(weight: CanonicalWeight, triples: Tensor, zero: bool) -> tuple[Tensor, Tensor]:
    """(ulps, abs error) [T, C] of every (triple, code) pair."""
    values = _code_values(weight).unsqueeze(0)
    if zero:
        values = values - triples[:, 2:3]
    a, b = values * triples[:, 0:1], values * triples[:, 1:2]
    return ulp_distance(a, b), (a - b).abs()


def _tables(weight: CanonicalWeight, scale_a: Tensor, scale_b: Tensor, zero: Tensor | None) -> _Tables | None:
    """Tables over the distinct (scale a, scale b, zero point) triples of the tiles (a sort)."""
    index, tiles, triples = _triples(scale_a, scale_b, zero)
    if triples.shape[0] * (16 if weight.scheme.weight.format in FOUR_BIT else 256) > TABLE_LIMIT:
        return None
    return _Tables(index, tiles, *_table(weight, triples, zero is not None))


def _byte_scale_tables(source: CanonicalWeight, target: CanonicalWeight, tile: tuple[int, int]) -> _Tables | None:
    """Tables without a sort, when both sides hold the same one-byte block scales (e4m3, e8m0) per
    group or channel, no zero points, and a global scale per partition: a tile's triple is then
    its (partition, scale byte), and both effective scales of all 256 x P of them are computed
    by ``effective_scale`` itself, on a layer made of one row per triple. None otherwise."""
    scale = source.scale
    if (
        scale.dtype.itemsize != 1
        or source.zero_point is not None
        or source.partitions != target.partitions
        or source.scheme.weight.scale.granularity not in ("group", "channel")
        or target.scheme.weight.scale.granularity != source.scheme.weight.scale.granularity
        or scale_tile(target, target.scale) != tile
        or scale.ndim != 2
        or scale.shape[0] != source.n
        or not _same(scale, target.scale)
    ):
        return None
    count = len(source.partitions)
    every = torch.arange(256, dtype=torch.uint8).repeat(count).reshape(-1, 1).view(scale.dtype)
    rows = (256,) * count
    sides = []
    for side in (source, target):
        fake = replace(side, n=256 * count, k=tile[1], scale=every, partitions=rows)
        sides.append(effective_scale(fake).reshape(-1))
    triples = torch.stack((sides[0], sides[1], torch.zeros_like(sides[0])), dim=1)
    offsets = torch.arange(count, dtype=torch.int32) * 256
    sizes = torch.tensor(source.partitions)
    index = scale.view(torch.uint8).to(torch.int32) + offsets.repeat_interleave(sizes).reshape(-1, 1)
    tiles = torch.bincount(index.reshape(-1), minlength=256 * count)
    return _Tables(index, tiles, *_table(source, triples, False))


def _row_tiles(units: _Units, tables: _Tables, tile: tuple[int, int]) -> Tensor | None:
    """The code units as [tiles, units per tile] when every tile is a run of whole units of one row."""
    n, width = units.codes.shape
    tiles_down, tiles_across = tables.index.shape
    if tile[0] != 1 or tiles_down != n or tile[1] % units.per_unit:
        return None
    per_tile = tile[1] // units.per_unit
    if width != tiles_across * per_tile:
        return None
    return units.codes.reshape(n * tiles_across, per_tile)


def _search(table: Tensor, tables: _Tables, units: _Units, row_tiles: Tensor, budget: list[int]) -> Tensor | None:
    """The largest entry of ``table`` [T, C] whose (triple, code) occurs (NaN first, as ``max``
    has it), trying entries from the largest down; None once more than ``budget[0]`` code units
    would have been gathered."""
    flat_index = tables.index.reshape(-1)
    floor = torch.tensor(-1, dtype=table.dtype)
    candidates = torch.where((tables.tiles > 0).unsqueeze(1), table, floor)
    while True:
        level = candidates.max()
        if level <= 0:
            return torch.zeros((), dtype=table.dtype)
        hits = candidates.isnan() if level.isnan() else candidates == level
        budget[0] -= SAMPLE_TILES * row_tiles.shape[1]
        if _sampled_hit(hits, tables, units, row_tiles):
            return level
        triples = hits.any(dim=1).nonzero().reshape(-1)
        for triple in triples[torch.argsort(tables.tiles[triples], descending=True, stable=True)].tolist():
            budget[0] -= int(tables.tiles[triple]) * row_tiles.shape[1] + flat_index.numel() // 4
            if budget[0] < 0:
                return None
            wanted = (units.holds & hits[triple]).any(dim=1)  # [256]: unit values holding a wanted code
            chosen = row_tiles.index_select(0, (flat_index == triple).nonzero().reshape(-1))
            if bool(wanted[chosen.to(torch.int32)].any()):
                return level
            candidates[triple] = torch.where(hits[triple], floor, candidates[triple])


def _sampled_hit(hits: Tensor, tables: _Tables, units: _Units, row_tiles: Tensor) -> bool:
    """Whether a sample of ``SAMPLE_TILES`` tiles spread over the layer holds a (triple, code) pair
    of ``hits`` [T, C]: one vectorized look that settles the search in the common case (a pair
    found is present; one not found is looked for in every tile of its triple)."""
    count = row_tiles.shape[0]
    step = max(1, count // SAMPLE_TILES)
    chosen = torch.arange(0, count, step)[:SAMPLE_TILES]
    wanted = hits.index_select(0, tables.index.reshape(-1).index_select(0, chosen).to(torch.int64))  # [S, C]
    units_held = units.holds.index_select(0, row_tiles.index_select(0, chosen).reshape(-1).to(torch.int64))
    held = units_held.reshape(chosen.numel(), row_tiles.shape[1], -1)  # [S, units per tile, C]
    return bool((held & wanted.unsqueeze(1)).any())


def _present_codes(units: _Units, tables: _Tables, tile: tuple[int, int]) -> Tensor:
    """bool [T, C]: which (triple, code) pairs occur, from one integer pass over the code units."""
    n, width = units.codes.shape
    triples = tables.tiles.numel()
    tile_rows, tile_columns = tile
    counts = torch.zeros(triples * 256, dtype=torch.int64)
    row_step = max(tile_rows, COUNT_SLAB_BYTES // max(1, width) // tile_rows * tile_rows)
    tile_of_unit = (torch.arange(width) * units.per_unit) // tile_columns
    for start in range(0, n, row_step):
        rows = slice(start, min(n, start + row_step))
        tile_of_row = torch.arange(rows.start, rows.stop) // tile_rows
        keys = tables.index.index_select(0, tile_of_row).index_select(1, tile_of_unit) * 256
        keys += units.codes[rows].to(torch.int32)
        counts += torch.bincount(keys.reshape(-1), minlength=triples * 256)
    present_units = (counts > 0).reshape(triples, 256)
    return (present_units.to(torch.float32) @ units.holds.to(torch.float32)) > 0


def _counted_deviation(source: CanonicalWeight, tables: _Tables, tile: tuple[int, int]) -> Deviation:
    """The fast path of the module docstring, from the (triple, code) tables."""
    units = _code_units(source, tile[1])
    row_tiles = _row_tiles(units, tables, tile)
    if row_tiles is not None:
        budget = [units.codes.numel()]
        ulps = _search(tables.ulps, tables, units, row_tiles, budget)
        abs_error = _search(tables.abs_error, tables, units, row_tiles, budget) if ulps is not None else None
        if ulps is not None and abs_error is not None:
            return Deviation(int(ulps), float(abs_error))
    present = _present_codes(units, tables, tile)
    if not bool(present.any()):
        return Deviation.none()
    return Deviation(int(tables.ulps[present].max()), float(tables.abs_error[present].max()))
