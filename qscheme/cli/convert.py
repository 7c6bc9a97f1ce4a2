"""`qscheme convert SRC DST --to SCHEME [--allow-requantize] [--without-tokenizer] [--force] [--json]`.

Converts a quantized checkpoint folder (or a quantized .gguf file: ``qscheme.writing.gguf_convert``;
or, to a DST ending in .gguf with a ``gguf/<TYPE>`` scheme, into one GGUF file llama.cpp loads:
``qscheme.writing.gguf_export``) into another scheme that shares its math (ModelOpt NVFP4
<-> compressed-tensors NVFP4, ...; see ``qscheme.writing.convert``): tensors renamed, scales
re-conventioned, codes untouched. The summary lists, per layer, the largest deviation of the
dequantized weight in float32 ulps that the conversion caused (for a requantized layer, its
relative error ||W - Q(W)||_F / ||W||_F instead), and its largest absolute error.
A conversion that would change codes is refused unless ``--allow-requantize``. DST is written
beside itself and appears only complete and verified; SRC is never modified. A progress bar
shows on a terminal; ``--json`` prints the summary as JSON. Exit 0 on success, 1 when the
checkpoint could not be converted or written, 2 on a usage or input error (an unknown scheme, a
refused requantization, a SRC that does not exist), 128 + the signal number when SIGTERM or
SIGHUP stopped it (130 on Ctrl-C).
"""

from __future__ import annotations

import argparse
from typing import Any

from qscheme.cli.writes import run_write


def register(sub: Any) -> None:
    parser = sub.add_parser("convert", help="convert a quantized checkpoint to another scheme with the same math")
    parser.add_argument(
        "src", metavar="SRC", help="a quantized checkpoint folder (compressed-tensors or ModelOpt) or a .gguf file"
    )
    parser.add_argument(
        "dst", metavar="DST", help="the output folder, or a .gguf file (must not exist, unless --force)"
    )
    parser.add_argument(
        "--to", "--scheme", dest="to", required=True, metavar="SCHEME", help="the target scheme (`qscheme schemes`)"
    )
    parser.add_argument(
        "--allow-requantize",
        action="store_true",
        help="dequantize and quantize again where the schemes do not share the math (the error is reported)",
    )
    parser.add_argument(
        "--without-tokenizer",
        action="store_true",
        help="a .gguf DST: write it even though SRC holds no tokenizer (llama.cpp cannot tokenize text with it)",
    )
    parser.add_argument("--force", action="store_true", help="replace DST if it exists")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(handler=run)


def layer_lines(rows: list[Any]) -> list[str]:
    """One line per converted layer: its action and how far its dequantized weight moved: the
    largest deviation in float32 ulps for a conversion (exact or near-exact), the relative error
    ``||W - Q(W)||_F / ||W||_F`` for a requantization (ulps of a new rounding are meaningless), and
    the largest absolute error."""
    written = [row for row in rows if row.action != "copied"]
    if not written:
        return []
    width = max(len(row.name) for row in written)
    lines = [f"{'layer':<{width}}  {'action':<11}  {'max ulps':>8}  {'relative error':>14}  max abs error"]
    for row in written:
        ulps = "-" if row.max_ulps is None else f"{row.max_ulps:g}"
        relative = "-" if row.relative_error is None else f"{row.relative_error:.3g}"
        error = "-" if row.max_abs_error is None else f"{row.max_abs_error:.3g}"
        lines.append(f"{row.name:<{width}}  {row.action:<11}  {ulps:>8}  {relative:>14}  {error}")
    return lines


def run(args: argparse.Namespace) -> int:
    from qscheme.errors import UsageError
    from qscheme.producers.gguf.config import is_gguf_file

    to_gguf = str(args.dst).lower().endswith(".gguf")
    if args.without_tokenizer and not to_gguf:
        raise UsageError("--without-tokenizer applies to a .gguf DST only; drop it or name a .gguf file")
    if to_gguf:
        if is_gguf_file(args.src):
            raise UsageError(
                f"{args.src} is already a GGUF file; convert writes a GGUF from a compressed-tensors or ModelOpt "
                "folder (use `qscheme quantize` to quantize a float GGUF)"
            )
        from qscheme.writing.gguf_export import export_gguf  # imports torch

        return run_write(
            "convert",
            args.dst,
            lambda progress: export_gguf(
                args.src,
                args.dst,
                args.to,
                allow_requantize=args.allow_requantize,
                without_tokenizer=args.without_tokenizer,
                force=args.force,
                progress=progress,
            ),
            as_json=args.json,
            details=lambda summary: layer_lines(summary.layers),
        )
    if is_gguf_file(args.src):
        from qscheme.writing.gguf_convert import convert_gguf  # imports torch

        convert = convert_gguf
    else:
        from qscheme.writing.convert import convert_checkpoint  # imports torch

        convert = convert_checkpoint
    return run_write(
        "convert",
        args.dst,
        lambda progress: convert(
            args.src,
            args.dst,
            args.to,
            allow_requantize=args.allow_requantize,
            force=args.force,
            progress=progress,
        ),
        as_json=args.json,
        details=lambda summary: layer_lines(summary.layers),
    )
