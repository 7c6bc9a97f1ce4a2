"""`qscheme run CHECKPOINT [--device D] [--kernel K] [--dtype T] [--json]`: does it compute here?

Loads every quantized module on the device, runs each on a fixed random input and compares
with its float32 reference (exact dequantized weight, exact activation emulation). Prints the
error and time per layer; exit 1 when any layer is beyond the tolerance.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from qscheme.checkpoint.defaults import DEFAULT_ROWS, DEFAULT_TOLERANCE
from qscheme.cli.output import print_json
from qscheme.errors import UsageError
from qscheme.kernels.problem import normalize_dtype

if TYPE_CHECKING:
    from qscheme.checkpoint.run import LayerRun

REAL_DEVICES = ("cpu", "cuda")


def register(sub: Any) -> None:
    parser = sub.add_parser("run", help="run every quantized layer of a checkpoint against its float32 reference")
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint folder (config.json + *.safetensors)")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N; a real device")
    parser.add_argument("--kernel", default=None, help="force this kernel for every layer")
    parser.add_argument("--dtype", default="bf16", help="activation dtype: bf16 (default), fp16 or fp32")
    parser.add_argument("--rows", type=int, default=DEFAULT_ROWS, help=f"input rows per layer (default {DEFAULT_ROWS})")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="max relative error allowed (default: "
        + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_TOLERANCE.items())
        + ")",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(handler=run)


def _row(result: LayerRun) -> list[str]:
    return [
        result.name,
        result.scheme,
        result.kernel,
        f"{result.n}x{result.k}",
        f"{result.max_relative_error:.2e}",
        f"{result.milliseconds:.3f}",
        "ok" if result.ok else "FAIL",
    ]


def run(args: argparse.Namespace) -> int:
    if args.device.split(":")[0] not in REAL_DEVICES:
        raise UsageError(
            f"--device {args.device!r}: `qscheme run` needs a real device (cpu, cuda, cuda:N); "
            "use `qscheme resolve CHECKPOINT --device smXY` for a simulated one"
        )
    try:
        dtype = normalize_dtype(args.dtype)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.rows < 1:
        raise UsageError(f"--rows must be >= 1, not {args.rows}")
    from qscheme.checkpoint.run import run_checkpoint  # imports torch

    results = run_checkpoint(
        args.checkpoint,
        device=args.device,
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
                "device": args.device,
                "activation_dtype": dtype,
                "layers": [r.as_json() for r in results],
                "failed": len(failed),
            }
        )
    else:
        from qscheme.kernels.render import text_table

        header = ("layer", "scheme", "kernel", "N x K", "max rel err", "ms", "status")
        sys.stdout.write(text_table([_row(r) for r in results], header) + "\n")
        tolerance = results[0].tolerance if results else DEFAULT_TOLERANCE[dtype]
        sys.stdout.write(
            f"{len(results) - len(failed)} of {len(results)} layers within tolerance {tolerance:g} "
            f"({dtype} inputs, {args.rows} rows, device {args.device})\n"
        )
    return 1 if failed else 0
