"""`qscheme quantize SRC DST --scheme NAME [--ignore PATTERN ...] [--calibration FILE] [--force] [--json]`.

Quantizes an unquantized Hugging Face safetensors checkpoint (a folder, sharded or not, or one
.safetensors file) into any scheme by round-to-nearest with the producer's arithmetic (see
``qscheme.writing.quantize``). A DST ending in ``.gguf`` quantizes a float GGUF file SRC into a
``gguf/<TYPE>`` scheme with llama.cpp's own arithmetic (``qscheme.writing.gguf_quantize``).
DST is written beside itself and appears only complete and verified; SRC is never modified.
The summary gives each layer's quantization error (relative, ||W - Q(W)||_F / ||W||_F, and largest
absolute; the worst layers in the text summary, every layer
in ``--json``). A progress bar shows on a terminal; ``--json`` prints the summary as JSON. Exit 0
on success, 1 when the checkpoint could not be quantized or written, 2 on a usage or input error
(an unknown scheme, a SRC that does not exist, a bad calibration file), 128 + the signal number
when SIGTERM or SIGHUP stopped it (130 on Ctrl-C).
"""

from __future__ import annotations

import argparse
from typing import Any

from qscheme.cli.writes import run_write


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "quantize", help="quantize an unquantized safetensors checkpoint into a scheme (round-to-nearest)"
    )
    parser.add_argument(
        "src", metavar="SRC", help="an unquantized checkpoint folder, one .safetensors file, or a float .gguf file"
    )
    parser.add_argument(
        "dst", metavar="DST", help="the output folder, or a .gguf file (must not exist, unless --force)"
    )
    parser.add_argument("--scheme", required=True, help="a scheme name (`qscheme schemes`) or a descriptor file")
    parser.add_argument(
        "--ignore",
        action="append",
        metavar="PATTERN",
        help="a module to leave unquantized: an exact name, re:REGEX or a wildcard; repeat for more "
        "(default: lm_head; giving any replaces the default)",
    )
    parser.add_argument(
        "--calibration",
        metavar="FILE",
        help="per-module input amax (JSON), needed by schemes with static activation scales (docs/writing.md)",
    )
    parser.add_argument("--force", action="store_true", help="replace DST if it exists")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if str(args.dst).lower().endswith(".gguf"):
        return _run_gguf(args)
    from qscheme.writing.quantize import quantize_checkpoint  # imports torch

    return run_write(
        "quantize",
        args.dst,
        lambda progress: quantize_checkpoint(
            args.src,
            args.dst,
            args.scheme,
            ignore=args.ignore,
            calibration=args.calibration,
            force=args.force,
            progress=progress,
        ),
        as_json=args.json,
    )


def _run_gguf(args: argparse.Namespace) -> int:
    """A .gguf DST: llama.cpp's quantization of a float GGUF (``qscheme.writing.gguf_quantize``)."""
    from qscheme.errors import UsageError

    if args.ignore or args.calibration:
        raise UsageError("--ignore and --calibration do not apply to a GGUF output (every weight is quantized)")
    from qscheme.writing.gguf_quantize import quantize_gguf  # imports torch

    return run_write(
        "quantize",
        args.dst,
        lambda progress: quantize_gguf(args.src, args.dst, args.scheme, force=args.force),
        as_json=args.json,
    )
