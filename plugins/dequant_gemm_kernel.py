"""The ``dequant_gemm`` kernel: dequantize tiles into the activation dtype, then a GEMM.

For large batches (prefill) a GEMM beats any GEMV: the weight is read once per call either way,
and the multiplication is what costs. ``prepare`` keeps the canonical weight as it is (on the
CPU the very tensors the layer holds: no copy), with the ``cpu_gemv`` extension's description
of it (views) where that extension takes its format.

``apply``, bfloat16 inputs, where the ``qscheme._tile_gemm`` extension runs AMX or AVX-512 BF16
(``qscheme.tile_gemm``): one call decodes panels of 32 weight rows, K chunk by K chunk, into
bfloat16 (each weight the reference's float32 value rounded once to nearest even) in a buffer
that stays in the core's cache, and multiplies them at once by every input row, on the AMX tiles
or with VDPBF16PS (dot products of 4 input rows by 4 weight rows; from 32 input rows, whole blocks
of 16 input rows packed as pairs of k against broadcast weight pairs: products summed in float32,
the output rounded once to bfloat16,
the bias added in float32 before). The panels are shared out over ``torch.get_num_threads()``
threads of the extension.

Otherwise (float32 inputs, neither AMX nor AVX-512 BF16, a format the extensions do not decode, packed
blocks): a tile of output rows at a time is dequantized exactly (the extension's bfloat16 decoder,
``cpu_gemv``'s float32 row decoder, ``cpu_gemv_blocks``' AVX-512 block decoder for packed blocks such
as GGUF's, or ``qscheme.canonical.dequantize_rows``: bit for bit the rows of
``qscheme.canonical.dequantize``), rounded once to the activation dtype (bfloat16; float32
inputs use the float32 tile as it is) and multiplied with ``torch.nn.functional.linear``
(oneDNN) into its columns of the output. The tiles are shared out over qscheme's slab workers
(``qscheme.slabs``), each running torch single-threaded, with the calling thread single-threaded
meanwhile: alternating multi-threaded dequantization with a GEMM on torch's OpenMP team, whose
threads spin after each parallel region, was 3-5x slower on two cores. A tile's buffers are
freed when it is done: nothing stays allocated.

Quantized activations (FP8, FP8_DYNAMIC, W8A8, NVFP4 W4A4) are emulated exactly as the reference
kernel emulates them (``ReferenceKernel.quantize_input``: float32, once per run of fused
partitions sharing their static input scales); with bfloat16 inputs the emulated float32 input
is then rounded once to bfloat16 for the GEMM. Where the fused tile GEMM runs and the native pass
takes the emulation (the FP8 and int8 rules, an AWQ pre-scale; ``qscheme.emulation.native_input_pass``),
the GEMM applies it to each row of x as it pads it: the same bits, without a pass or a buffer of
its own (at 256 x 4096 a separate pass had cost 0.44-0.76 ms beside a 20 ms GEMM, with its fresh
buffer and cold caches); elsewhere ``qscheme.emulation.prepare_input`` computes it in one native
pass, or torch does.

Numerics: with bfloat16 inputs each weight is rounded once to bfloat16 (half a bfloat16 ulp,
``2**-9 * |w|``), products are summed in float32 by the GEMM and the output rounded once; an
AWQ input pre-scale multiplies the input in float32 and the product is rounded once to the
input's dtype, as is an emulated quantized input. AMX and VDPBF16PS (and oneDNN's bfloat16 GEMM on
them) read bfloat16 subnormals (below 2**-126 in magnitude) as zero. With float32 inputs the math is the
reference kernel's (float32 weight, float32 products) up to the order of the sums.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import torch
from qscheme_plugins.reference_kernel import ReferenceKernel, ReferenceState, input_scalings, scale_arguments
from torch import Tensor

from qscheme import emulation_native, slabs, tile_gemm
from qscheme.canonical import CanonicalWeight, dequantize_rows, scale_tile
from qscheme.emulation import native_input_pass
from qscheme.emulation_native import InputPass
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
    """The canonical weight on the device (no copy on a CPU), what the input needs before the
    GEMM (an AWQ pre-scale, activation quantization: the reference kernel's state, or None), and
    the ``cpu_gemv`` extension's view of the same tensors where it decodes them (``native``)."""

    canonical: CanonicalWeight
    emulation: ReferenceState | None
    native: Any = None
    blocks: Any = None  # packed blocks: the cpu_gemv_blocks layout (views) its AVX-512 decoder reads
    # the emulation as passes the fused GEMM applies to x itself, built on the first call (_input_passes)
    passes: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


def _extension_layout(weight: CanonicalWeight, module: str, function: str) -> Any:
    """``module.function(weight)`` (a ``qscheme._cpu_gemv`` layout: views of the canonical tensors),
    or None where the extension is not built, the weight is not on the CPU, or the extension does
    not take its formats (a UsageError): then the torch path runs."""
    if weight.codes.device.type != "cpu" or weight.input_permutation is not None:
        return None
    try:
        from qscheme import cpu_gemv

        layout_of = getattr(importlib.import_module(module), function)
    except ImportError:
        return None
    if not cpu_gemv.available():
        return None
    try:
        return layout_of(weight)
    except UsageError:
        return None


def native_layout(weight: CanonicalWeight) -> Any:
    """The ``cpu_gemv`` extension's layout of ``weight`` (plus per-row scales and small tables), or
    None (``_extension_layout``)."""
    return _extension_layout(weight, "qscheme.cpu_gemv", "layout_of")


def block_layout(weight: CanonicalWeight) -> Any:
    """``qscheme.cpu_gemv_blocks``' layout of a weight of packed blocks, whose AVX-512 decoder the
    tiles use, or None (other packings, ``_extension_layout``)."""
    if weight.scheme.weight.blocks is None:
        return None
    return _extension_layout(weight, "qscheme.cpu_gemv_blocks", "block_layout_of")


class DequantGemmKernel:
    """KernelImplementation of ``dequant_gemm`` (see the module docstring). ``native=False``
    keeps to the torch dequantization even where the extension would decode the weight."""

    def __init__(self, native: bool = True) -> None:
        self.native = native

    def prepare(self, weight: CanonicalWeight, device: torch.device) -> DequantGemmState:
        device = torch.device(device)
        canonical = weight.to(device)
        emulation = None
        if weight.scheme.activation is not None or weight.input_pre_scale is not None:
            pre_scale = weight.input_pre_scale
            emulation = ReferenceState(
                canonical=canonical,
                k=weight.k,
                activation=weight.scheme.activation,
                scalings=input_scalings(canonical, device) if weight.scheme.activation is not None else (),
                pre_scale=None if pre_scale is None else pre_scale.to(device=device, dtype=torch.float32),
            )
        return DequantGemmState(
            canonical=canonical,
            emulation=emulation,
            native=native_layout(canonical) if self.native else None,
            blocks=block_layout(canonical) if self.native else None,
        )

    def apply(self, state: DequantGemmState, x: Tensor, bias: Tensor | None) -> Tensor:
        weight = state.canonical
        if x.shape[-1] != weight.k:
            raise UsageError(f"input has {x.shape[-1]} features in its last dim; the layer takes K={weight.k}")
        dtype = x.dtype
        rows = x.reshape(-1, weight.k)
        y = torch.empty(rows.shape[0], weight.n, dtype=dtype, device=rows.device)
        if rows.shape[0] > 0:
            threads = torch.get_num_threads()
            # torch single-threaded meanwhile: the input's few elementwise operations need no OpenMP
            # team, whose threads would spin on the cores the extension's (or the slabs') threads use
            with slabs.single_threaded_caller():
                bias = None if bias is None else bias.to(device=rows.device, dtype=dtype)
                fused = self.native and state.native is not None and dtype == torch.bfloat16 and tile_gemm.fused()
                for start, stop, inputs, input_pass in _pieces(state, rows, threads, fused):
                    if fused:
                        bias32 = None if bias is None else bias.to(torch.float32)
                        tile_gemm.gemm(state.native, inputs, bias32, start, stop, threads, y[:, start:stop], input_pass)
                    else:
                        _tiles(state, inputs, bias, start, stop, y)
        return y.reshape(*x.shape[:-1], weight.n)


def _pieces(
    state: DequantGemmState, rows: Tensor, threads: int = 1, fused: bool = False
) -> list[tuple[int, int, Tensor, InputPass | None]]:
    """(first output row, last + 1, the input those rows multiply, contiguous in the input's dtype,
    the pass the fused GEMM applies to it or None): per run of fused partitions sharing their
    static input scales, the input pre-scaled and quantized as the reference kernel does. With
    ``fused`` (the fused GEMM runs), the input itself and the pass where the native pass takes the
    layer's emulation; otherwise its result (one native pass on ``threads`` workers where it runs:
    ``qscheme.emulation.prepare_input``)."""
    n = state.canonical.n
    if state.emulation is None:
        return [(0, n, rows.contiguous(), None)]
    passes = _input_passes(state) if fused and emulation_native.enabled() else None
    if passes is not None:
        inputs = rows.contiguous()
        return [(start, stop, inputs, input_pass) for start, stop, input_pass in passes]
    return [
        (0, n, values.contiguous(), None)
        if scaling is None
        else (scaling.start, scaling.stop, values.contiguous(), None)
        for scaling, values in ReferenceKernel().quantize_input(state.emulation, rows, rows.dtype, threads)
    ]


def _input_passes(state: DequantGemmState) -> list[tuple[int, int, InputPass]] | None:
    """The layer's emulation as native input passes, one per run of partitions sharing their
    static scales (built once), or None where a native pass does not take it."""
    if "passes" not in state.passes:
        emulation = state.emulation
        assert emulation is not None
        k = state.canonical.k
        if emulation.activation is None:
            runs = [(0, state.canonical.n, native_input_pass(None, k, pre_scale=emulation.pre_scale))]
        else:
            runs = [
                (
                    scaling.start,
                    scaling.stop,
                    native_input_pass(
                        emulation.activation, k, **scale_arguments(scaling), pre_scale=emulation.pre_scale
                    ),
                )
                for scaling in emulation.scalings
            ]
        complete = all(found is not None for _, _, found in runs)
        state.passes["passes"] = [(a, b, c) for a, b, c in runs if c is not None] if complete else None
    found: list[tuple[int, int, InputPass]] | None = state.passes["passes"]
    return found


def _tiles(state: DequantGemmState, inputs: Tensor, bias: Tensor | None, start: int, stop: int, y: Tensor) -> None:
    """y[:, start:stop] = inputs @ W[start:stop]^T (+ bias) a tile of rows at a time (see the
    module docstring)."""
    weight = state.canonical
    rows = tile_rows(weight.n, weight.k, scale_tile(weight, weight.scale)[0])
    tiles = [slice(first, min(stop, first + rows)) for first in range(start, stop, rows)]
    inference = torch.is_inference_mode_enabled()

    def work(tile: slice) -> None:
        # on a worker (torch single-threaded there): this tile's dequantization and GEMM
        with torch.inference_mode(inference), torch.no_grad():
            _multiply_tile(state, inputs, bias, tile, y)

    with slabs.single_threaded_caller():  # see the module docstring
        slabs.run_slabs(work, tiles, inputs.device)


def tile_weight(state: DequantGemmState, start: int, stop: int, dtype: torch.dtype) -> Tensor:
    """Rows [start, stop) of the weight in ``dtype``: the reference's float32 values, rounded
    once to bfloat16 for bfloat16 inputs (by the extensions where they decode the layer)."""
    if state.native is not None and dtype == torch.bfloat16 and tile_gemm.available():
        return tile_gemm.dequantize_rows(state.native, start, stop, threads=1)
    if state.blocks is not None:
        from qscheme import cpu_gemv_blocks

        rows = cpu_gemv_blocks.dequantize_rows(state.blocks, start, stop, dtype, threads=1)
        if rows is not None:
            return rows
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
    if tile.stop <= tile.start:
        return
    rows = tile_weight(state, tile.start, tile.stop, inputs.dtype)
    part = None if bias is None else bias[tile]
    y[:, tile] = torch.nn.functional.linear(inputs, rows, part)
