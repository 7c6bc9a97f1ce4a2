"""The canonical weight of one linear layer, its decoded elements, and its exact dequantization.

``CanonicalWeight`` holds a layer's tensors in the one form kernels see (the layout is described
in ``qscheme.canonical``, which converts checkpoint tensors into it and re-exports everything
public here). This module is what every consumer of that form shares: decoding the elements,
folding the global scale into the block scales as the producer does (``effective_scale``), the
tile of weight a scale covers, and the reference dequantization every kernel is tested against.
It sits below ``qscheme.canonical`` and ``qscheme.scale_checks``: canonicalizing runs the scale
checks, and the scale checks read the weight through these functions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from qscheme.descriptor import Scheme
from qscheme.descriptor.blocks import BlockLayout
from qscheme.descriptor.consistency import FOUR_BIT
from qscheme.errors import QuantizeError
from qscheme.formats import decode
from qscheme.formats.blocks import decode_blocks, empty_output
from qscheme.slabs import BLOCK_SLAB_ELEMENTS, run_slabs, single_threaded_caller, slabs_for


@dataclass(frozen=True)
class CanonicalWeight:
    """The kernel-facing tensors of one linear layer (see ``qscheme.canonical``'s module docstring)."""

    scheme: Scheme
    n: int
    k: int
    codes: Tensor
    scale: Tensor
    global_scale: Tensor | None = None
    global_scale_divisor: Tensor | None = None
    zero_point: Tensor | None = None
    partitions: tuple[int, ...] = ()
    input_scale: Tensor | None = None
    input_global_scale: Tensor | None = None
    input_global_scale_divisor: Tensor | None = None
    input_pre_scale: Tensor | None = None
    input_permutation: Tensor | None = None

    @property
    def num_partitions(self) -> int:
        return len(self.partitions)

    def tensors(self) -> dict[str, Tensor]:
        """Every tensor field that is set, by field name (``TENSOR_FIELDS`` order)."""
        return {name: value for name in TENSOR_FIELDS if (value := getattr(self, name)) is not None}

    def kernel_tensors(self) -> dict[str, Tensor]:
        """The tensors a kernel consumes (excludes the exact-rounding provenance)."""
        fields = {
            "codes": self.codes,
            "scale": self.scale,
            "global_scale": self.global_scale,
            "zero_point": self.zero_point,
            "input_scale": self.input_scale,
            "input_global_scale": self.input_global_scale,
            "input_pre_scale": self.input_pre_scale,
            "input_permutation": self.input_permutation,
        }
        return {name: value for name, value in fields.items() if value is not None}

    def to(self, device: torch.device | str) -> CanonicalWeight:
        """The same tensors on another device."""
        moved: dict[str, Any] = {
            name: (value.to(device) if isinstance(value, Tensor) else value) for name, value in self.__dict__.items()
        }
        return replace(self, **moved)


# CanonicalWeight's tensor fields; the rest (scheme, n, k, partitions) describe them.
TENSOR_FIELDS: tuple[str, ...] = (
    "codes",
    "scale",
    "global_scale",
    "global_scale_divisor",
    "zero_point",
    "input_scale",
    "input_global_scale",
    "input_global_scale_divisor",
    "input_pre_scale",
    "input_permutation",
)


# Decoded values of both nibbles of every byte, per 4-bit element format: [256, 2] float32.
def _nibble_pair_table(element: str, table: tuple[float, ...] | None = None) -> Tensor:
    nibbles = torch.arange(16, dtype=torch.uint8)
    if table is not None:  # a codebook: code i is worth table[i] (in float32)
        values = torch.tensor(table, dtype=torch.float32)
    elif element == "int4":
        values = ((nibbles.to(torch.int16) ^ 8) - 8).to(torch.float32)
    elif element == "uint4":
        values = nibbles.to(torch.float32)
    else:
        values = decode(nibbles, element)
    low = values.repeat(16)  # byte b: low nibble b & 15
    high = values.repeat_interleave(16)  # high nibble b >> 4
    return torch.stack((low, high), dim=1).contiguous()


_NIBBLE_PAIR_TABLES: dict[tuple[str, tuple[float, ...] | None, torch.device], Tensor] = {}


def _decode_nibbles(codes: Tensor, element: str, k: int, table: tuple[float, ...] | None = None) -> Tensor:
    """uint8 [rows, ceil(k/2)] of two 4-bit codes -> float32 [rows, k] (``table``: a codebook's values)."""
    key = (element, table, codes.device)
    if key not in _NIBBLE_PAIR_TABLES:
        _NIBBLE_PAIR_TABLES[key] = _nibble_pair_table(element, table).to(codes.device)
    pairs = _NIBBLE_PAIR_TABLES[key].index_select(0, codes.reshape(-1).to(torch.int32))
    return pairs.view(codes.shape[0], -1)[:, :k]


_BYTE_TABLES: dict[tuple[torch.dtype, torch.device], Tensor] = {}


def _decode_float8(codes: Tensor) -> Tensor:
    """float8 codes -> float32 through a 256-entry table of torch's own conversion (the same
    values, bit for bit, several times faster than converting element by element on a CPU)."""
    key = (codes.dtype, codes.device)
    if key not in _BYTE_TABLES:
        every_byte = torch.arange(256, dtype=torch.uint8, device=codes.device)
        _BYTE_TABLES[key] = every_byte.view(codes.dtype).to(torch.float32)
    indices = codes.contiguous().view(torch.uint8).reshape(-1).to(torch.int32)
    return _BYTE_TABLES[key].index_select(0, indices).view(codes.shape)


def _decode_rows(weight: CanonicalWeight, rows: slice) -> Tensor:
    element = weight.scheme.weight.format
    codes = weight.codes[rows]
    if element in FOUR_BIT:
        return _decode_nibbles(codes, element, weight.k, weight.scheme.weight.table)
    if codes.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return _decode_float8(codes)
    return codes.to(torch.float32)


def element_values(weight: CanonicalWeight) -> Tensor:
    """The decoded elements as float32 [N, K] (before zero points and scales); e2m1's negative
    zero (code 0x8) decodes to +0.0."""
    return _decode_rows(weight, slice(0, weight.n))


def _expand_rows(per_partition: Tensor, partitions: tuple[int, ...]) -> Tensor:
    """[P] -> [N, 1] by repeating each partition's value over its rows."""
    sizes = torch.tensor(partitions, device=per_partition.device)
    return per_partition.repeat_interleave(sizes).reshape(-1, 1)


def effective_scale(weight: CanonicalWeight, scale_rows: slice | None = None) -> Tensor:
    """float32 scale in its own layout with the global scale folded in as the producer does.

    For a stored divisor this is ``block_scale / divisor`` and for a multiplier
    ``block_scale * multiplier``, each rounded once in float32, exactly as compressed-tensors
    and ModelOpt compute it. ``scale_rows``: only these rows of the result (the same values as
    slicing the whole result: every element is computed on its own); a single tensor-wide scale
    stays one value.
    """
    spec = weight.scheme.weight.scale
    stored = weight.scale if scale_rows is None or spec.granularity == "tensor" else weight.scale[scale_rows]
    if spec.format == "e8m0":
        scale = decode(stored, "e8m0")
    else:
        scale = stored.to(torch.float32)
    if weight.global_scale is None:
        if spec.granularity == "tensor":
            rows = _expand_rows(scale.expand(len(weight.partitions)), weight.partitions)
            return rows if scale_rows is None else rows[scale_rows]
        return scale
    rows_of = _global_rows(weight, scale)
    if weight.global_scale_divisor is not None:
        return scale / _some_rows(rows_of(weight.global_scale_divisor), scale_rows)
    return scale * _some_rows(rows_of(weight.global_scale), scale_rows)


def _some_rows(value: Tensor, rows: slice | None) -> Tensor:
    """``value[rows]`` for a per-row value ([N, 1]); a single value as it is."""
    return value if rows is None or (value.ndim == 1 and value.shape[0] == 1) else value[rows]


def _global_rows(weight: CanonicalWeight, scale: Tensor):  # type: ignore[no-untyped-def]
    spec = weight.scheme.weight.scale
    if spec.granularity in ("group", "channel"):
        return lambda value: _expand_rows(value, weight.partitions)
    if len(weight.partitions) != 1:
        raise QuantizeError(
            f"scheme {weight.scheme.name}: per-partition global scales need a group or channel scale, "
            f"not {spec.granularity!r}"
        )
    return lambda value: value.reshape(1)


def scale_tile(weight: CanonicalWeight, scale: Tensor) -> tuple[int, int]:
    """Weight rows and columns under one element of ``effective_scale``'s result."""
    spec = weight.scheme.weight.scale
    if spec.granularity == "group":
        assert spec.group_size is not None
        return 1, spec.group_size
    if spec.granularity == "block":
        assert spec.block is not None
        return spec.block
    return 1, weight.k  # channel, or tensor scales as one per row


def expand_tiles(value: Tensor, tile: tuple[int, int], rows: slice, k: int) -> Tensor:
    """The per-tile ``value`` over weight rows ``rows`` as [rows, k] (or broadcastable)."""
    tile_rows, tile_columns = tile
    first, last = rows.start // tile_rows, -(-rows.stop // tile_rows)
    part = value[first:last]
    if tile_rows > 1:
        offset = rows.start - first * tile_rows
        part = part.repeat_interleave(tile_rows, dim=0)[offset : offset + rows.stop - rows.start]
    if part.shape[-1] == 1:
        return part
    return part.repeat_interleave(tile_columns, dim=1)[:, :k]


def dequantize(weight: CanonicalWeight) -> Tensor:
    """The float32 [N, K] weight, bit-identical to the producer's own float32 dequantization.

    ``(element - zero_point) * effective_scale``, one rounding, computed slab by slab of rows
    (see qscheme.slabs).
    """
    with single_threaded_caller():
        return dequantize_rows(weight, 0, weight.n)


def dequantize_rows(weight: CanonicalWeight, start: int, stop: int, out: Tensor | None = None) -> Tensor:
    """Rows [start, stop) of ``dequantize(weight)`` as float32 [stop - start, K], bit for bit,
    computed from those rows' codes, scales and zero points only (a kernel that must not hold
    the whole float32 weight dequantizes it a chunk of rows at a time). ``out``: a contiguous
    float32 [stop - start, K] tensor on the weight's device to write them into (a buffer reused
    from chunk to chunk).

    The slabs run on qscheme's worker threads as for ``dequantize``, but the calling thread's
    torch thread count is left as it is: changing it costs milliseconds per call (the BLAS
    re-initializes), which a kernel calling this chunk after chunk cannot afford."""
    if not 0 <= start <= stop <= weight.n:
        raise QuantizeError(
            f"scheme {weight.scheme.name}: rows [{start}, {stop}) are not within the weight's N={weight.n} rows; "
            f"pass 0 <= start <= stop <= {weight.n}"
        )
    if weight.input_permutation is not None:
        # the codes hold the input channels in the permuted order (GPTQ act-order): canonical
        # column j is input channel input_permutation[j]
        permuted = _dequantize_slabs(weight, start, stop, None)
        return _check_out(weight, start, stop, out).index_copy_(1, weight.input_permutation, permuted)
    return _dequantize_slabs(weight, start, stop, out)


def _check_out(weight: CanonicalWeight, start: int, stop: int, out: Tensor | None) -> Tensor:
    """``out`` checked (or made): a contiguous float32 [stop - start, K] tensor on the weight's device."""
    shape = (stop - start, weight.k)
    if out is None:
        if weight.codes.device.type == "cpu":
            return empty_output(shape)
        return torch.empty(shape, dtype=torch.float32, device=weight.codes.device)
    if out.shape != shape or out.dtype != torch.float32 or out.device != weight.codes.device or not out.is_contiguous():
        raise QuantizeError(
            f"scheme {weight.scheme.name}: out= must be a contiguous float32 [{shape[0]}, {weight.k}] tensor on "
            f"{weight.codes.device} for rows [{start}, {stop}), got {out.dtype} {list(out.shape)} on {out.device}; "
            "pass such a tensor or out=None"
        )
    return out


def _decode_block_rows(
    weight: CanonicalWeight, layout: BlockLayout, start: int, stop: int, out: Tensor | None
) -> Tensor:
    fresh = out is None
    out = _check_out(weight, start, stop, out)
    inference = torch.is_inference_mode_enabled()

    def work(rows: slice) -> None:
        with torch.inference_mode(inference):
            decode_blocks(weight.codes[start + rows.start : start + rows.stop], layout, out=out[rows], fresh=fresh)

    # one pass of the C loop per slab: larger slabs than the torch passes' (whose per-slab cost
    # would dominate), a few per thread
    run_slabs(work, slabs_for(out.device, stop - start, weight.k, 1, BLOCK_SLAB_ELEMENTS), out.device)
    return out


def _dequantize_slabs(weight: CanonicalWeight, start: int, stop: int, out: Tensor | None) -> Tensor:
    k = weight.k
    layout = weight.scheme.weight.blocks
    if layout is not None:  # packed blocks: decoded as their declaration says (qscheme.formats.blocks)
        return _decode_block_rows(weight, layout, start, stop, out)
    tile = scale_tile(weight, weight.scale)
    # the scale (and zero-point) rows under weight rows [start, stop); weight row r is row
    # r - offset of them
    first, last = start // tile[0], -(-stop // tile[0])
    offset = first * tile[0]
    scale = effective_scale(weight, slice(first, last))
    if weight.scheme.weight.scale.granularity == "tensor" and scale.numel() == 1:
        scale = scale.reshape(1, 1).expand(last - first, 1)  # one scale, broadcast as one per row
    zero = None if weight.zero_point is None else weight.zero_point[first:last].to(torch.float32)
    shape = (stop - start, k)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=weight.codes.device)
    elif (
        out.shape != shape or out.dtype != torch.float32 or out.device != weight.codes.device or not out.is_contiguous()
    ):
        raise QuantizeError(
            f"scheme {weight.scheme.name}: out= must be a contiguous float32 [{shape[0]}, {k}] tensor on "
            f"{weight.codes.device} for rows [{start}, {stop}), got {out.dtype} {list(out.shape)} on {out.device}; "
            "pass such a tensor or out=None"
        )
    # group scales over whole groups multiply through a view, without expanding the scale
    grouped = tile[0] == 1 and tile[1] < k and k % tile[1] == 0

    # the workers run in the caller's inference mode (thread-local), or writing into an ``out``
    # made under torch.inference_mode() would be refused
    inference = torch.is_inference_mode_enabled()

    def work(rows: slice) -> None:
        with torch.inference_mode(inference):
            _work(rows)

    def _work(rows: slice) -> None:
        values = _decode_rows(weight, slice(start + rows.start, start + rows.stop))
        local = slice(start + rows.start - offset, start + rows.stop - offset)
        if grouped:
            groups = (rows.stop - rows.start, k // tile[1], tile[1])
            values = values.reshape(groups)
            if zero is not None:
                values = values - zero[local].unsqueeze(-1)
            torch.mul(values, scale[local].unsqueeze(-1), out=out[rows].view(groups))
            return
        if zero is not None:
            values = values - expand_tiles(zero, tile, local, k)
        torch.mul(values, expand_tiles(scale, tile, local, k), out=out[rows])

    run_slabs(work, slabs_for(out.device, stop - start, k, tile[0]), out.device)
    return out
