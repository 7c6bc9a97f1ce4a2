"""The torch reference kernel: exact dequantize-then-matmul, with exact activation emulation.

``prepare`` keeps the canonical weight as it is (moved to the device): no dequantized copy.
``apply`` multiplies the input by the AWQ pre-scale if any, quantizes and dequantizes it as the
scheme says (``qscheme.emulation``) when the scheme quantizes activations, and then, a chunk of
output rows at a time, dequantizes those rows (``qscheme.canonical.dequantize_rows``: bit for
bit the rows of ``qscheme.canonical.dequantize``) and multiplies them. A fused layer whose
partitions carry different static input scales quantizes the shared input once per distinct
scale, each partition with its own, as separate layers would. The result is returned in the
input's dtype.

Memory: a chunk holds at most ``CHUNK_BYTES`` (8 MiB) of float32 rows and never more bytes
than half a copy of the whole layer in the input's dtype; one such buffer is reused chunk after
chunk and freed when the call returns, so nothing stays allocated after a forward. (glibc's
malloc keeps some freed blocks for reuse: measured up to about 40 MiB on four 4096x4096
layers and 25 MiB on a 154-layer model, not growing with the number of layers;
tests/test_reference_memory.py measures both.)

Speed: every call dequantizes the weight again, on qscheme's slab workers
(``qscheme.slabs``), with the calling thread single-threaded for the whole call (the
chunk products included): switching torch's thread count per chunk, or letting the caller's
OpenMP team spin beside the workers, cost several times the dequantization itself. On a
4096x4096 layer a call at M=1 takes about ten times as long as with a kept float32 copy (the
figures are in docs/benchmarks.md).

Why float32 and not the activation dtype: the products are taken in float32 (input and chunk),
so the output is ``x @ dequantize(weight).T`` rounded once to the input's dtype, the exact
math that the other kernels' tests compare against. Multiplying in bfloat16 would round every
weight to bfloat16 first; with float32 chunks the memory bound above holds anyway.

Opt-in cache: ``QSCHEME_REFERENCE_CACHE=1`` keeps one dequantized copy of each layer's weight
per input dtype (built chunk by chunk at the first call with that dtype) and multiplies in that
dtype: faster, at the memory of an unquantized model, and no longer exact (the weight is
rounded to the input's dtype). ``0`` or unset: no cache. The variable is a switch like every
QSCHEME_* one (1/true/yes/on, 0/false/no/off/empty); other values raise UsageError.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from qscheme import slabs
from qscheme.canonical import CanonicalWeight, dequantize_rows, scale_tile
from qscheme.descriptor import ActivationSpec
from qscheme.emulation import prepare_input
from qscheme.environment import env_flag
from qscheme.errors import UsageError

CHUNK_BYTES = 8 << 20  # float32 bytes of weight rows dequantized at once (at most)
CACHE_VARIABLE = "QSCHEME_REFERENCE_CACHE"


def cache_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``QSCHEME_REFERENCE_CACHE`` asks for the dequantized-weight cache (see the module
    docstring); read as every qscheme switch is (``qscheme.environment.env_flag``): UsageError
    naming the value when it is neither on nor off."""
    return env_flag(CACHE_VARIABLE, environ)


def chunk_rows(n: int, k: int, activation_bytes: int, tile_rows: int = 1) -> int:
    """Output rows dequantized at once: float32 rows within ``CHUNK_BYTES`` and within half a copy
    of the whole [n, k] layer in the activation dtype (``activation_bytes`` per element), a
    multiple of ``tile_rows`` (the scale's rows) where that fits; at least one row."""
    budget = min(CHUNK_BYTES, n * k * activation_bytes // 2)
    rows = max(1, budget // max(1, k * 4))
    return rows - rows % tile_rows if rows >= tile_rows else rows


@dataclass(frozen=True)
class InputScaling:
    """The rows [start, stop) of the output whose input is quantized with these static scales."""

    start: int
    stop: int
    input_scale: Tensor | None = None
    input_global_scale: Tensor | None = None
    input_global_scale_divisor: Tensor | None = None

    def same_scales(self, other: InputScaling) -> bool:
        pairs = (
            (self.input_scale, other.input_scale),
            (self.input_global_scale, other.input_global_scale),
            (self.input_global_scale_divisor, other.input_global_scale_divisor),
        )
        return all(
            (a is None and b is None) or (a is not None and b is not None and bool(torch.equal(a, b))) for a, b in pairs
        )


@dataclass(frozen=True)
class ReferenceState:
    """What ``prepare`` keeps: the canonical weight on the device (no dequantized copy), how to
    quantize the input, and the opt-in cache (``cache`` is None unless asked for)."""

    canonical: CanonicalWeight
    k: int
    activation: ActivationSpec | None
    scalings: tuple[InputScaling, ...]
    pre_scale: Tensor | None
    cache: dict[torch.dtype, Tensor] | None = field(default=None, compare=False)

    @property
    def device(self) -> torch.device:
        return self.canonical.codes.device


def _partition_value(values: Tensor | None, index: int) -> Tensor | None:
    if values is None:
        return None
    flat = values.reshape(-1)
    return flat[index].reshape(1) if flat.numel() > 1 else flat.reshape(1)


def scale_arguments(scaling: InputScaling) -> dict[str, Tensor | None]:
    """The activation rules' static-scale arguments (``qscheme.emulation``) for one run of
    partitions: the global scale's divisor where the layer has one, else its multiplier."""
    divisor = scaling.input_global_scale_divisor
    return {
        "input_scale": scaling.input_scale,
        "input_global_scale": None if divisor is not None else scaling.input_global_scale,
        "input_global_scale_divisor": divisor,
    }


def input_scalings(weight: CanonicalWeight, device: torch.device) -> tuple[InputScaling, ...]:
    """One InputScaling per run of adjacent partitions that share their static input scales."""
    divisor = weight.input_global_scale_divisor
    partitions = weight.partitions or (weight.n,)
    runs: list[InputScaling] = []
    start = 0
    for index, size in enumerate(partitions):
        scaling = InputScaling(
            start,
            start + size,
            *(
                None if v is None else v.to(device=device, dtype=torch.float32)
                for v in (
                    _partition_value(weight.input_scale, index),
                    _partition_value(weight.input_global_scale, index),
                    _partition_value(divisor, index),
                )
            ),
        )
        if runs and runs[-1].same_scales(scaling):
            previous = runs[-1]
            runs[-1] = InputScaling(
                previous.start,
                scaling.stop,
                previous.input_scale,
                previous.input_global_scale,
                previous.input_global_scale_divisor,
            )
        else:
            runs.append(scaling)
        start += size
    return tuple(runs)


class ReferenceKernel:
    """KernelImplementation of the ``reference`` kernel (any device, every built-in scheme)."""

    def prepare(self, weight: CanonicalWeight, device: torch.device) -> ReferenceState:
        device = torch.device(device)
        cache: dict[torch.dtype, Tensor] | None = {} if cache_requested() else None
        pre_scale = weight.input_pre_scale
        return ReferenceState(
            canonical=weight.to(device),
            k=weight.k,
            activation=weight.scheme.activation,
            scalings=input_scalings(weight, device) if weight.scheme.activation is not None else (),
            pre_scale=None if pre_scale is None else pre_scale.to(device=device, dtype=torch.float32),
            cache=cache,
        )

    def quantize_input(
        self, state: ReferenceState, x: Tensor, dtype: torch.dtype = torch.float32, threads: int = 1
    ) -> list[tuple[InputScaling | None, Tensor]]:
        """The input each output slice multiplies: pre-scaled, then fake-quantized, in float32 (or
        those values rounded once to ``dtype``; ``qscheme.emulation.prepare_input``, one native pass
        on ``threads`` workers where it runs)."""
        values = x.to(device=state.device)
        if state.activation is None:
            return [(None, prepare_input(values, None, pre_scale=state.pre_scale, dtype=dtype, threads=threads))]
        return [
            (
                scaling,
                prepare_input(
                    values,
                    state.activation,
                    **scale_arguments(scaling),
                    pre_scale=state.pre_scale,
                    dtype=dtype,
                    threads=threads,
                ),
            )
            for scaling in state.scalings
        ]

    def apply(self, state: ReferenceState, x: Tensor, bias: Tensor | None) -> Tensor:
        if x.shape[-1] != state.k:
            raise UsageError(f"input has {x.shape[-1]} features in its last dim; the layer takes K={state.k}")
        weight = state.canonical
        rows = chunk_rows(weight.n, weight.k, x.element_size(), scale_tile(weight, weight.scale)[0])
        with slabs.single_threaded_caller():  # see the module docstring: Speed
            return self._multiply(state, x, bias, rows)

    def _multiply(self, state: ReferenceState, x: Tensor, bias: Tensor | None, rows: int) -> Tensor:
        weight = state.canonical
        cached = None if state.cache is None else self._cached(state, x.dtype)
        pieces = []
        buffer: Tensor | None = None  # one chunk of float32 rows, reused chunk after chunk
        for scaling, values in self.quantize_input(state, x):
            start, stop = (0, weight.n) if scaling is None else (scaling.start, scaling.stop)
            if cached is not None:
                pieces.append(torch.matmul(values.to(cached.dtype), cached[start:stop].t()).to(torch.float32))
                continue
            if buffer is None:
                buffer = torch.empty(min(rows, weight.n), weight.k, dtype=torch.float32, device=state.device)
            for first in range(start, stop, rows):
                last = min(stop, first + rows)
                chunk = dequantize_rows(weight, first, last, out=buffer[: last - first])
                pieces.append(torch.matmul(values, chunk.t()))
        y = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)
        if bias is not None:
            y = y + bias.to(device=y.device, dtype=torch.float32)
        return y.to(x.dtype)

    def _cached(self, state: ReferenceState, dtype: torch.dtype) -> Tensor:
        """The opt-in cache: the whole weight in ``dtype``, built chunk by chunk on first use."""
        assert state.cache is not None
        found = state.cache.get(dtype)
        if found is None:
            weight = state.canonical
            found = torch.empty(weight.n, weight.k, dtype=dtype, device=state.device)
            rows = chunk_rows(weight.n, weight.k, found.element_size())
            buffer = torch.empty(min(rows, weight.n), weight.k, dtype=torch.float32, device=state.device)
            for first in range(0, weight.n, rows):
                last = min(weight.n, first + rows)
                found[first:last] = dequantize_rows(weight, first, last, out=buffer[: last - first])
            state.cache[dtype] = found
        return found
