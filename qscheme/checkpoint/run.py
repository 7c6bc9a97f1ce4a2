"""``run_checkpoint``: run every quantized layer of a checkpoint against its float32 reference.

Each layer gets a fixed random input (seeded, [rows, K], values rounded through the activation
dtype so the reference sees exactly the same numbers). The reference is the accuracy
reference of the design: the exact dequantized weight and, for activation-quantized schemes,
the exact activation emulation, all in float32 on the CPU (the ``reference`` kernel). The
error is max |y - y_ref| / max |y_ref| over the layer's outputs.

A kernel that raises in prepare() or apply(), or returns an output that is not [rows, N] in
the input dtype (QuantLinear raises KernelExecutionError for both), does not stop the run: that
layer's result is a failure naming the kernel, its plugin and the exception, and the other
layers still run. Kernels whose implementation failed to import never run a layer: the resolver
rejects them, and ``registry.unavailable_kernels()`` lists them with their import errors.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from qscheme.checkpoint.defaults import DEFAULT_ROWS, DEFAULT_TOLERANCE
from qscheme.checkpoint.load import load_checkpoint
from qscheme.checkpoint.plan import FuseSpec
from qscheme.kernels.interface import KernelExecutionError
from qscheme.kernels.problem import normalize_dtype
from qscheme.modules import QuantLinear

REFERENCE_KERNEL = "reference"
_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class LayerRun:
    """One layer's result: its kernel, error against the reference, and time per forward."""

    name: str
    scheme: str
    kernel: str
    n: int
    k: int
    max_relative_error: float
    milliseconds: float
    tolerance: float
    failure: str = ""  # why the kernel could not compute the layer (then the error and time are NaN)

    @property
    def ok(self) -> bool:
        return not self.failure and self.max_relative_error <= self.tolerance

    def as_json(self) -> dict[str, object]:
        return {
            "layer": self.name,
            "scheme": self.scheme,
            "kernel": self.kernel,
            "n": self.n,
            "k": self.k,
            "max_relative_error": self.max_relative_error,
            "milliseconds": self.milliseconds,
            "tolerance": self.tolerance,
            "ok": self.ok,
            "failure": self.failure or None,
        }


def _reference_output(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    from qscheme.kernels.registry import get_declaration, load_implementation

    implementation = load_implementation(get_declaration(REFERENCE_KERNEL))
    cpu = torch.device("cpu")
    state = implementation.prepare(layer.weight_canonical.to(cpu), cpu)
    bias = layer.bias.to(cpu) if layer.bias is not None else None
    out: torch.Tensor = implementation.apply(state, x.to(device=cpu, dtype=torch.float32), bias)
    return out.to(torch.float32)


def _time(layer: QuantLinear, x: torch.Tensor, repeats: int) -> tuple[torch.Tensor, float]:
    with torch.no_grad():
        y = layer(x)  # warm-up
        if x.device.type == "cuda":
            torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            y = layer(x)
            if x.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return y, sorted(times)[len(times) // 2] * 1000


def run_checkpoint(
    path: str | Path,
    *,
    device: str = "cpu",
    kernel: str | None = None,
    activation_dtype: str = "bfloat16",
    fuse: FuseSpec | None = None,
    rows: int = DEFAULT_ROWS,
    tolerance: float | None = None,
    repeats: int = 5,
    seed: int = 0,
    on_layer: Callable[[LayerRun], None] | None = None,
    progress: bool | None = None,
) -> list[LayerRun]:
    """Load the checkpoint on ``device`` and run each quantized layer against its reference."""
    dtype = normalize_dtype(activation_dtype)
    limit = DEFAULT_TOLERANCE[dtype] if tolerance is None else tolerance
    checkpoint = load_checkpoint(
        path, device=device, kernel=kernel, fuse=fuse, activation_dtype=dtype, progress=progress
    )
    results = []
    for index, (name, layer) in enumerate(checkpoint.items()):
        generator = torch.Generator().manual_seed(seed + index)
        x = torch.randn(rows, layer.in_features, generator=generator).to(_TORCH_DTYPES[dtype])
        reference = _reference_output(layer, x.to(torch.float32))
        y, milliseconds, failure = _run_kernel(layer, x, device, repeats)
        relative = math.nan
        if y is not None:
            peak = float(reference.abs().max())
            error = float((y.to(device="cpu", dtype=torch.float32) - reference).abs().max())
            relative = error / peak if peak > 0 else error
        result = LayerRun(
            name=name,
            scheme=layer.scheme.name,
            kernel=layer.kernel.name,
            n=layer.out_features,
            k=layer.in_features,
            max_relative_error=relative,
            milliseconds=milliseconds,
            tolerance=limit,
            failure=failure,
        )
        results.append(result)
        if on_layer is not None:
            on_layer(result)
    return results


def _run_kernel(
    layer: QuantLinear, x: torch.Tensor, device: str, repeats: int
) -> tuple[torch.Tensor | None, float, str]:
    """(output, milliseconds, "") or (None, NaN, why the layer's kernel failed)."""
    try:
        layer.prepare(normalize_dtype(x.dtype))
        y, milliseconds = _time(layer, x.to(device), repeats)
    except KernelExecutionError as exc:  # names the kernel, its plugin, the layer and the scheme
        return None, math.nan, str(exc)
    return y, milliseconds, ""
