"""`qscheme run CHECKPOINT [--device D] [--kernel K] [--dtype T] [--json]`: does it compute here?

Loads every quantized module on the device, runs each on a fixed random input and compares
with its float32 reference (exact dequantized weight, exact activation emulation). Prints the
error and time per layer; exit 1 when any layer is beyond the tolerance or its kernel failed
(raised, or returned the wrong shape or dtype: the layer is FAIL with the reason, and the other
layers still run), 2 on a bad option or a checkpoint folder that does not exist. Kernels whose
code failed to import are listed with the import error (``unavailable_kernels`` in JSON): the
resolver rejected them, and the layers ran on the kernel shown in their row.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import TYPE_CHECKING, Any

from qscheme.checkpoint.defaults import DEFAULT_ROWS, DEFAULT_TOLERANCE
from qscheme.cli.inputs import checkpoint_argument
from qscheme.cli.output import print_json
from qscheme.errors import UsageError
from qscheme.kernels.problem import normalize_dtype

if TYPE_CHECKING:
    from qscheme.checkpoint.run import LayerRun

REAL_DEVICES = ("cpu", "cuda")
MAX_ROWS = 65536  # 64K rows of K=16384 bf16 inputs are 2 GiB already
SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def register(sub: Any) -> None:
    parser = sub.add_parser("run", help="run every quantized layer of a checkpoint against its float32 reference")
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint folder (config.json + *.safetensors)")
    parser.add_argument(
        "--device",
        default="cpu",
        help="a real device: cpu (default), cuda or cuda:N (`qscheme resolve` takes a simulated smXY instead)",
    )
    parser.add_argument("--kernel", default=None, help="force this kernel for every layer (overrides QSCHEME_KERNEL)")
    parser.add_argument("--dtype", default="bf16", help="activation dtype: bf16 (default), fp16 or fp32")
    parser.add_argument(
        "--rows", type=int, default=DEFAULT_ROWS, help=f"input rows per layer, 1 to {MAX_ROWS} (default {DEFAULT_ROWS})"
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="max relative error allowed, a finite number > 0 (default: "
        + ", ".join(f"{SHORT_DTYPES[k]} {v:g}" for k, v in DEFAULT_TOLERANCE.items())
        + ")",
    )
    parser.add_argument(
        "--json", action="store_true", help="print JSON (a NaN or infinite error or time is written as null)"
    )
    parser.set_defaults(handler=run)


def _number(value: float, spec: str) -> str:
    return format(value, spec) if math.isfinite(value) else "-" if math.isnan(value) else str(value)


def _row(result: LayerRun) -> list[str]:
    return [
        result.name,
        result.scheme,
        result.kernel,
        f"{result.n}x{result.k}",
        _number(result.max_relative_error, ".2e"),
        _number(result.milliseconds, ".3f"),
        "ok" if result.ok else "FAIL",
    ]


def _device(text: str) -> str:
    """The device, checked: cpu, cuda or cuda:N (``qscheme.modules.checked_device``: cpu:N is the CPU)."""
    if text.split(":")[0] not in REAL_DEVICES:
        raise UsageError(
            f"--device {text!r}: `qscheme run` needs a real device (cpu, cuda, cuda:N); "
            "use `qscheme resolve CHECKPOINT --device smXY` for a simulated one"
        )
    from qscheme.modules import checked_device  # imports torch

    return str(checked_device(text))


def _check_numbers(rows: int, tolerance: float | None) -> None:
    if not 1 <= rows <= MAX_ROWS:
        raise UsageError(f"--rows {rows}: must be between 1 and {MAX_ROWS}")
    if tolerance is not None and not (math.isfinite(tolerance) and tolerance > 0):
        raise UsageError(f"--tolerance {tolerance:g}: must be a finite number > 0, such as 0.02")


def run(args: argparse.Namespace) -> int:
    device = _device(args.device)
    try:
        dtype = normalize_dtype(args.dtype)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    _check_numbers(args.rows, args.tolerance)
    checkpoint_argument(args.checkpoint)
    from qscheme.checkpoint.run import run_checkpoint  # imports torch
    from qscheme.kernels import registry

    results = run_checkpoint(
        args.checkpoint,
        device=device,
        kernel=args.kernel,
        activation_dtype=dtype,
        rows=args.rows,
        tolerance=args.tolerance,
        progress=None if not args.json else False,
    )
    failed = [r for r in results if not r.ok]
    if args.json:
        print_json(
            {
                "checkpoint": args.checkpoint,
                "device": device,
                "activation_dtype": dtype,
                "layers": [r.as_json() for r in results],
                "failed": len(failed),
                "unavailable_kernels": registry.unavailable_kernels(),
            }
        )
    else:
        from qscheme.kernels.render import text_table

        header = ("layer", "scheme", "kernel", "N x K", "max rel err", "ms", "status")
        out = [text_table([_row(r) for r in results], header)]
        kernel_failures = [r.failure for r in results if r.failure]
        if kernel_failures:
            out.extend(["", "kernel failures:", *(f"  {failure}" for failure in kernel_failures), ""])
        unavailable = registry.unavailable_lines()
        if unavailable:
            out.extend(["", *unavailable, ""])
        tolerance = results[0].tolerance if results else DEFAULT_TOLERANCE[dtype]
        out.append(
            f"{len(results) - len(failed)} of {len(results)} layers within tolerance {tolerance:g} "
            f"({dtype} inputs, {args.rows} rows, device {device})"
        )
        if not results:
            out.append(
                "note: no quantized layers: the checkpoint's config declares no quantization, or every "
                f"layer is ignored (see `qscheme inspect {args.checkpoint}`); nothing was run"
            )
        sys.stdout.write("\n".join(out) + "\n")
    return 1 if failed else 0
