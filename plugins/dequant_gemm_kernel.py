"""The ``dequant_gemm`` kernel: dequantize row tiles into the activation dtype, then torch's GEMM.

For large batches (prefill) a GEMM beats any GEMV: the weight is read once per call either way,
and the multiplication is what costs. ``prepare`` keeps the canonical weight as it is (on the
CPU the very tensors the layer holds: no copy). ``apply`` dequantizes a tile of output rows at
a time with the reference dequantization (``qscheme.canonical.dequantize_rows``: bit for bit the
rows of ``qscheme.canonical.dequantize``) into a float32 buffer, rounds the tile once to the
activation dtype (bfloat16; float32 inputs use the float32 tile as it is) and multiplies it with
``torch.nn.functional.linear`` (on a CPU, oneDNN's bfloat16 GEMM on AVX-512 BF16 / AMX) into
its columns of the output. A tile's buffers are freed when it is done: nothing stays allocated.

Threads: the tiles are shared out over qscheme's slab workers (``qscheme.slabs``), each running
torch single-threaded, one tile's dequantization and GEMM after the other, with the calling
thread single-threaded meanwhile. Alternating multi-threaded dequantization on the workers with
a GEMM on torch's OpenMP team, whose threads spin after each parallel region, was 3-5x slower
on two cores.

Numerics: with bfloat16 inputs each weight is rounded once to bfloat16 (half a bfloat16 ulp,
``2**-9 * |w|``), products are summed in float32 by the GEMM and the output rounded once; an
AWQ input pre-scale multiplies the input in float32 and the product is rounded once to the
input's dtype. With float32 inputs the math is the reference kernel's (float32 weight, float32
products) up to the order of the sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from qscheme import slabs
from qscheme.canonical import CanonicalWeight, dequantize_rows, scale_tile
from qscheme.emulation import apply_pre_scale
from qscheme.errors import UsageError

TILE_BYTES = 4 << 20  # float32 bytes of weight rows dequantized at once by one thread (at most)


def tile_rows(n: int, k: int, unit: int = 1) -> int:
    """Output rows per tile: float32 rows within ``TILE_BYTES``, a multiple of ``unit`` (the
    scale's rows) where that fits; at least one row, at most ``n``."""
    rows = max(1, TILE_BYTES // max(1, 4 * k))
    if rows >= unit:
        rows -= rows % unit
    return min(rows, n)


@dataclass(frozen=True)
class DequantGemmState:
    """The canonical weight on the device (no copy on a CPU), the input pre-scale, and the
    ``cpu_gemv`` extension's view of the same tensors where it decodes them (``native``)."""

    canonical: CanonicalWeight
    pre_scale: Tensor | None
    native: Any = None


def native_layout(weight: CanonicalWeight) -> Any:
    """The ``cpu_gemv`` extension's layout of ``weight`` (views of its canonical tensors, plus
    per-row scales and small tables), or None where the extension is not built, the weight is
    not on the CPU, or the extension does not take its formats: then the torch path runs."""
    if weight.codes.device.type != "cpu" or weight.input_permutation is not None:
        return None
    try:
        from qscheme import cpu_gemv
    except ImportError:
        return None
    if not cpu_gemv.available():
        return None
    try:
        return cpu_gemv.layout_of(weight)
    except UsageError:  # a format the extension does not decode: the torch path takes it
        return None


class DequantGemmKernel:
    """KernelImplementation of ``dequant_gemm`` (see the module docstring). ``native=False``
    keeps to the torch dequantization even where the extension would decode the weight."""

    def __init__(self, native: bool = True) -> None:
        self.native = native

    def prepare(self, weight: CanonicalWeight, device: torch.device) -> DequantGemmState:
        device = torch.device(device)
        pre_scale = weight.input_pre_scale
        canonical = weight.to(device)
        return DequantGemmState(
            canonical=canonical,
            pre_scale=None if pre_scale is None else pre_scale.to(device=device, dtype=torch.float32),
            native=native_layout(canonical) if self.native else None,
        )

    def apply(self, state: DequantGemmState, x: Tensor, bias: Tensor | None) -> Tensor:
        weight = state.canonical
        if x.shape[-1] != weight.k:
            raise UsageError(f"input has {x.shape[-1]} features in its last dim; the layer takes K={weight.k}")
        dtype = x.dtype
        inputs = x.reshape(-1, weight.k)
        if state.pre_scale is not None:
            inputs = apply_pre_scale(inputs.to(torch.float32), state.pre_scale).to(dtype)
        y = torch.empty(inputs.shape[0], weight.n, dtype=dtype, device=inputs.device)
        if inputs.shape[0] > 0:
            inputs = inputs.contiguous()
            bias = None if bias is None else bias.to(device=inputs.device, dtype=dtype)
            rows = tile_rows(weight.n, weight.k, scale_tile(weight, weight.scale)[0])
            tiles = [slice(start, min(weight.n, start + rows)) for start in range(0, weight.n, rows)]
            inference = torch.is_inference_mode_enabled()

            def work(tile: slice) -> None:
                # on a worker (torch single-threaded there): this tile's dequantization and GEMM
                with torch.inference_mode(inference), torch.no_grad():
                    _multiply_tile(state, inputs, bias, tile, y)

            with slabs.single_threaded_caller():  # see the module docstring: Threads
                slabs.run_slabs(work, tiles, inputs.device)
        return y.reshape(*x.shape[:-1], weight.n)


def tile_weight(state: DequantGemmState, start: int, stop: int, dtype: torch.dtype) -> Tensor:
    """Rows [start, stop) of the weight in ``dtype``: the reference's float32 values, rounded
    once to bfloat16 for bfloat16 inputs (by the extension where it decodes the layer)."""
    if state.native is not None:
        from qscheme import cpu_gemv

        return cpu_gemv.dequantize_rows(state.native, start, stop, dtype, threads=1)
    exact = dequantize_rows(state.canonical, start, stop)
    return exact if dtype == torch.float32 else exact.to(dtype)


def dequantized_tiles(state: DequantGemmState, dtype: torch.dtype) -> list[tuple[int, int, Tensor]]:
    """Every tile (start, stop, rows in ``dtype``) as ``apply`` multiplies them (for tests:
    ``torch.cat`` of the tiles is ``dequantize(weight).to(dtype)``, bit for bit)."""
    weight = state.canonical
    rows = tile_rows(weight.n, weight.k, scale_tile(weight, weight.scale)[0])
    return [
        (start, min(weight.n, start + rows), tile_weight(state, start, min(weight.n, start + rows), dtype))
        for start in range(0, weight.n, rows)
    ]


def _multiply_tile(state: DequantGemmState, inputs: Tensor, bias: Tensor | None, tile: slice, y: Tensor) -> None:
    """y[:, tile] = inputs @ W[tile]^T (+ bias[tile]), W's rows dequantized exactly and rounded
    once to the inputs' dtype."""
    rows = tile_weight(state, tile.start, tile.stop, inputs.dtype)
    part = None if bias is None else bias[tile]
    y[:, tile] = torch.nn.functional.linear(inputs, rows, part)
