"""cpu_gemv's loops for one to four bf16 rows of 4-bit codes, side by side in one run.

    python benchmarks/cpu_gemv_loops.py [--scheme NAME ...] [--shape 4096x4096] [--threads 1 --threads 2]
    python benchmarks/cpu_gemv_loops.py --smoke     # tiny shapes, a few calls

For each scheme (default: NVFP4A16, MXFP4A16, int4 in groups of 128 and of 32, int4 with zero
points), shape, thread count and M in 1-4, ``qscheme.cpu_gemv.gemv`` runs the same layout and the
same bf16 input with each of its loops selected by its environment switches: the float32 loop
(``QSCHEME_CPU_GEMV_INT16=0``), the VNNI integer loop (``QSCHEME_CPU_GEMV_BF16DOT=0``) and the
AVX512-BF16 loop (both on), the tiles off (``QSCHEME_CPU_GEMV_AMX=0``); beside them bf16
``F.linear`` on the dense weight. A loop the layer or this CPU does not run is left out
(``cpu_gemv.dot_loop`` names the loop each setting runs). Times are medians of interleaved rounds
(``kernel_table.interleaved_medians``); ratios are the VNNI loop's time over each loop's (above 1:
faster than the VNNI loop) and bf16 ``F.linear``'s over the BF16 loop's. "default" names the loop
the extension takes with no switch set, the one the resolver's ``cpu_gemv`` runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # kernel_table, beside this script

from kernel_table import interleaved_medians, markdown_table, microseconds, parse_shape, ratio

from qscheme import cpu_gemv
from qscheme.canonical import CanonicalWeight, dequantize
from qscheme.catalog import load_scheme
from qscheme.triton.samples import random_weight

SCHEMES = (
    "compressed-tensors/NVFP4A16",
    "compressed-tensors/MXFP4A16",
    "compressed-tensors/W4A16",
    "compressed-tensors/W4A16_G32",
    "compressed-tensors/W4A16_ASYM",
)
SHAPES = ((4096, 4096), (14336, 4096))
ROWS = (1, 2, 3, 4)
ROUNDS, SAMPLE_SECONDS = 7, 0.02
SWITCHES = ("QSCHEME_CPU_GEMV_INT16", "QSCHEME_CPU_GEMV_BF16DOT", "QSCHEME_CPU_GEMV_AMX")
# each loop's switches (QSCHEME_CPU_GEMV_AMX=0 in all: the tiles take M >= 4 on AMX CPUs)
LOOPS = {
    "float32": {"QSCHEME_CPU_GEMV_INT16": "0", "QSCHEME_CPU_GEMV_BF16DOT": "0"},
    "vnni": {"QSCHEME_CPU_GEMV_INT16": "1", "QSCHEME_CPU_GEMV_BF16DOT": "0"},
    "bf16": {"QSCHEME_CPU_GEMV_INT16": "1", "QSCHEME_CPU_GEMV_BF16DOT": "1"},
}


@contextmanager
def switches(values: dict[str, str]) -> Iterator[None]:
    """The extension reads its switches at every call: set them for the block, then restore."""
    before = {name: os.environ.get(name) for name in SWITCHES}
    os.environ.update({"QSCHEME_CPU_GEMV_AMX": "0", **values})
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def runs(layout: cpu_gemv.GemvLayout, loop: str, rows: int) -> bool:
    """Whether ``loop``'s switches make the extension run that loop for ``rows`` rows."""
    with switches(LOOPS[loop]):
        taken = cpu_gemv.dot_loop(layout, rows)
    return (taken or "float32") == loop


def default_loop(layout: cpu_gemv.GemvLayout, rows: int) -> str:
    with switches({}):
        os.environ.pop("QSCHEME_CPU_GEMV_INT16", None)
        os.environ.pop("QSCHEME_CPU_GEMV_BF16DOT", None)
        return cpu_gemv.dot_loop(layout, rows) or "float32"


def timed(layout: cpu_gemv.GemvLayout, loop: str, x: torch.Tensor) -> Callable[[], object]:
    def call() -> object:
        with switches(LOOPS[loop]):
            return cpu_gemv.gemv(layout, x)

    return call


def measure(name: str, weight: CanonicalWeight, threads: int, rows_list: Sequence[int], rounds: int) -> list[list[str]]:
    layout = cpu_gemv.layout_of(weight)
    dense = dequantize(weight).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    lines = []
    for rows in rows_list:
        x = torch.randn(rows, weight.k, generator=generator).to(torch.bfloat16)
        loops = [loop for loop in LOOPS if runs(layout, loop, rows)]
        calls: dict[str, Callable[[], object]] = {loop: timed(layout, loop, x) for loop in loops}
        calls["F.linear bf16"] = lambda x=x: F.linear(x, dense)
        times = interleaved_medians(calls, rounds, SAMPLE_SECONDS)
        cell = {loop: microseconds(times[loop]) if loop in times else "-" for loop in LOOPS}
        lines.append(
            [
                name,
                f"{weight.n}x{weight.k}",
                str(threads),
                str(rows),
                default_loop(layout, rows),
                *(cell[loop] for loop in LOOPS),
                ratio(times.get("vnni"), times.get("float32")),
                ratio(times.get("vnni"), times.get("bf16")),
                ratio(times["F.linear bf16"], times.get("bf16")),
            ]
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", action="append", help=f"scheme name (repeatable; default: {', '.join(SCHEMES)})")
    parser.add_argument("--shape", action="append", type=parse_shape, help="N x K, e.g. 4096x4096 (repeatable)")
    parser.add_argument("--threads", type=int, action="append", help="torch threads (repeatable; default: torch's)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"samples per time (default {ROUNDS})")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and few calls: checks the script only")
    args = parser.parse_args(argv)
    if cpu_gemv.native() is None:
        print("qscheme._cpu_gemv is not built here: nothing to compare", file=sys.stderr)
        return 1
    shapes = [(64, 256)] if args.smoke else (args.shape or list(SHAPES))
    rounds = 1 if args.smoke else args.rounds
    thread_counts = args.threads or [torch.get_num_threads()]
    header = ["scheme", "N x K", "threads", "M", "default", "float32 us", "vnni us", "bf16 us"]
    header += ["float32 vs vnni", "bf16 vs vnni", "bf16 vs F.linear bf16"]
    rows = []
    before = torch.get_num_threads()
    try:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            for name in args.scheme or SCHEMES:
                for n, k in shapes:
                    weight = random_weight(load_scheme(name), n, k, seed=1, scale_dtype="bfloat16")
                    rows += measure(name, weight, threads, ROWS, rounds)
    finally:
        torch.set_num_threads(before)
    print(f"CPU ISA: {cpu_gemv.isa()}; bf16 inputs; times are medians of interleaved rounds (us per call).")
    print("\n".join(markdown_table(header, rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
