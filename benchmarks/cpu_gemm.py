"""Every kernel that runs a scheme on the CPU, against torch's dense matmul and the reference kernel.

    python benchmarks/cpu_gemm.py [--scheme NAME ...] [--threads 1 --threads 2] [--markdown out.md]
    python benchmarks/cpu_gemm.py --smoke     # tiny shapes, a few calls (the test's run)

For each scheme (default: compressed-tensors W4A16, FP8 and FP8_DYNAMIC, ModelOpt FP8 and
W4A16_AWQ) the resolver lists the kernels that accept the layer on this CPU (every accepted one,
not only the one it would choose; kernels that need the Triton interpreter are left out, since
the interpreter is a test path). Each runs a ``QuantLinear`` built from random weights of the
scheme (``qscheme.triton.samples.random_weight``, float scales in bf16 where the scheme allows,
as checkpoints keep them) with that kernel forced, and is first checked against the reference
kernel at M=16 (largest error relative to the largest output).

Timed: one forward call with bf16 inputs, for M in 1, 4, 16, 64 and (N, K) in (4096, 4096) and
(14336, 4096) (``--shape 4096x14336`` adds the down projection's; each shape of that size adds
about three minutes on two cores), beside ``torch.nn.functional.linear`` with a bf16 weight (bf16
input) and with a float32 weight (float32 input). The peers of one (scheme, N, K, M) are timed
in turn, round after round (the order rotating), after a warm-up call and a calibrating call
each; a sample is as many back-to-back calls as fill 20 ms (one call, for most), and each time
is the median of 5 samples (3 for a call slower than half a second, which would pass 2.5 s). Ratios (how
many times faster than bf16 ``F.linear``, fp32 ``F.linear`` and the reference kernel) come from
the same rounds. GB/s: the bytes a call moves (the kernel state's tensors, the bf16 input and
output) over its time, and that as a fraction of the best dense GEMV bandwidth of the same
rounds ("vs dense GB/s": the larger of bf16 and fp32 ``F.linear``'s weight, input and output bytes
over their times). ``--threads`` sets ``torch.set_num_threads`` (repeatable: the whole run once per
count, each row naming its count; default: torch's own).

Memory: for each (scheme, kernel) at 4096x4096, after the layer's first forward, the distinct
storages of its buffers (the canonical tensors: the quantized weight with its scales) and of
every tensor reachable from its prepared kernel state, as a multiple of the canonical tensors
and of a bf16 weight. The reference kernel keeps no copy (1x: it dequantizes chunks of rows at
every call, which is what makes it slow). For 4-bit weight-only schemes the run ends with whether each
kernel is faster than the reference kernel at every M <= 16 and holds at most twice the
canonical tensors there.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # kernel_table, beside this script

from kernel_table import (
    MemoryRow,
    build_layer,
    device_facts,
    interleaved_medians,
    markdown_table,
    memory_row,
    memory_table,
    microseconds,
    parse_shape,
    ratio,
    reference_output,
    relative_error,
    runnable_kernels,
    state_bytes,
)

SCHEMES = (
    "compressed-tensors/W4A16",
    "compressed-tensors/NVFP4A16",
    "compressed-tensors/MXFP4A16",
    "compressed-tensors/W8A16_G32",
    "modelopt/fp8_pb_wo",
    "compressed-tensors/FP8",
    "compressed-tensors/FP8_DYNAMIC",
    "modelopt/FP8",
    "modelopt/W4A16_AWQ",
)
# --gguf: GGUF's block types (real blocks: qscheme's GGUF quantizer, llama.cpp's bytes), at decode sizes
GGUF_SCHEMES = ("gguf/Q4_0", "gguf/Q8_0", "gguf/Q4_K", "gguf/Q6_K", "gguf/IQ4_NL")
GGUF_M_VALUES = (1, 4)
GGUF_SLAB_ROWS = 256  # rows quantized once and repeated down N (quantizing 14336 rows would take minutes)
M_VALUES = (1, 4, 16, 64)
SHAPES = ((4096, 4096), (14336, 4096))  # a full run: about 4-5 minutes on 2 busy cores
MEMORY_SHAPE = (4096, 4096)
ROUNDS, SAMPLE_SECONDS, WARMUP, PEER_BUDGET_SECONDS = 5, 0.02, 1, 2.5
SMOKE_M_VALUES = (1, 4)
SMOKE_SHAPES = ((128, 256),)
SMOKE_ROUNDS, SMOKE_SAMPLE_SECONDS = 2, 0.0  # one call a sample
CHECK_M = 16
ERROR_LIMIT = 2.0**-6  # a kernel further than this from the reference kernel is reported and fails the run
REFERENCE = "reference"


@dataclass(frozen=True)
class Row:
    scheme: str
    kernel: str
    n: int
    k: int
    m: int
    seconds: float
    bf16_seconds: float
    fp32_seconds: float
    reference_seconds: float | None
    moved_bytes: int
    threads: int = 1
    dense_bytes_per_second: float = 0.0  # the best dense GEMV bandwidth of the same rounds

    @property
    def bytes_per_second(self) -> float:
        return self.moved_bytes / self.seconds

    def cells(self) -> list[str]:
        return [
            self.scheme,
            self.kernel,
            f"{self.n}x{self.k}",
            f"{self.m}",
            microseconds(self.seconds),
            microseconds(self.bf16_seconds),
            microseconds(self.fp32_seconds),
            ratio(self.bf16_seconds, self.seconds),
            ratio(self.fp32_seconds, self.seconds),
            ratio(self.reference_seconds, self.seconds),
            f"{self.bytes_per_second / 1e9:.1f}",
            f"{self.threads}",
            f"{self.bytes_per_second / self.dense_bytes_per_second:.2f}" if self.dense_bytes_per_second else "-",
        ]


HEADER = (
    "scheme", "kernel", "N x K", "M", "us", "bf16 us", "fp32 us", "vs bf16", "vs fp32", "vs reference", "GB/s",
    "threads", "vs dense GB/s",
)  # fmt: skip


@dataclass(frozen=True)
class Check:
    scheme: str
    kernel: str
    n: int
    k: int
    error: float

    def cells(self) -> list[str]:
        flag = "" if self.error <= ERROR_LIMIT else " (over the limit)"
        return [self.scheme, self.kernel, f"{self.n}x{self.k}", f"{self.error:.1e}{flag}"]


def measure_scheme(
    scheme_name: str, n: int, k: int, args: argparse.Namespace, facts: object
) -> tuple[list[Row], list[Check], list[MemoryRow], list[str]]:
    """Rows, checks, memory rows (at the memory shape) and notes for one scheme and shape."""
    from qscheme.catalog import load_scheme
    from qscheme.triton.samples import model_scale_dtype, random_weight

    scheme = load_scheme(scheme_name)
    if scheme.weight.blocks is not None:
        weight = gguf_weight(scheme, n, k)
    else:
        weight = random_weight(scheme, n, k, seed=1, scale_dtype=model_scale_dtype(scheme, torch.bfloat16))
    runnable = runnable_kernels(weight, facts, only=args.kernel or (), skip=args.skip or ())  # type: ignore[arg-type]
    notes = list(runnable.notes)
    if not runnable.kernels:
        notes.append(f"{scheme.name} {n}x{k}: no kernel runs it here")
        return [], [], [], notes
    layers = {name: build_layer(weight, name, "cpu", facts) for name in runnable.kernels}  # type: ignore[arg-type]
    moved = {name: state_bytes(layer) for name, layer in layers.items()}
    generator = torch.Generator().manual_seed(2)
    x_check = torch.randn(CHECK_M, k, generator=generator).to(torch.bfloat16)
    expected = reference_output(weight, x_check)
    checks = []
    with torch.inference_mode():
        for name, layer in layers.items():
            checks.append(Check(scheme.name, name, n, k, relative_error(layer(x_check), expected)))
    dense_bf16 = torch.randn(n, k, generator=generator).to(torch.bfloat16)
    dense_fp32 = dense_bf16.float()
    rows = []
    for m in args.m_values:
        x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
        x32 = x.float()
        calls: dict[str, Callable[[], object]] = {
            "F.linear bf16": lambda x=x: F.linear(x, dense_bf16),
            "F.linear fp32": lambda x32=x32: F.linear(x32, dense_fp32),
        }
        for name, layer in layers.items():
            calls[name] = lambda layer=layer, x=x: layer(x)
        with torch.inference_mode():
            times = interleaved_medians(calls, args.rounds, args.sample_seconds, WARMUP, PEER_BUDGET_SECONDS)
        io = (m * k + m * n) * 2
        # the best dense GEMV bandwidth of these rounds: the weight (and input and output) over the time
        dense = max((n * k * 2 + io) / times["F.linear bf16"], (n * k * 4 + 2 * io) / times["F.linear fp32"])
        for name in layers:
            row = Row(
                scheme.name,
                name,
                n,
                k,
                m,
                times[name],
                times["F.linear bf16"],
                times["F.linear fp32"],
                times.get(REFERENCE),
                moved[name] + io,
                torch.get_num_threads(),
                dense,
            )
            rows.append(row)
            print("| " + " | ".join(row.cells()) + " |", flush=True)
    memory = [memory_row(scheme, name, layer) for name, layer in layers.items()] if (n, k) == args.memory_shape else []
    return rows, checks, memory, notes


def gguf_weight(scheme: object, n: int, k: int) -> object:
    """A canonical weight of real GGUF blocks [n, k]: a random slab quantized by qscheme's GGUF
    quantizer (bit-identical to llama.cpp's) and repeated down the rows."""
    from qscheme.canonical_blocks import canonical_blocks
    from qscheme.producers.gguf.quants.api import quantize_blocks

    rows = min(n, GGUF_SLAB_ROWS)
    dense = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    raw = quantize_blocks(dense, scheme.name.removeprefix("gguf/"))  # type: ignore[attr-defined]
    raw = raw.repeat(-(-n // rows), 1)[:n].contiguous()
    return canonical_blocks(scheme, raw, n, k)  # type: ignore[arg-type]


def claims(rows: Sequence[Row], memory: Sequence[MemoryRow], shape: tuple[int, int]) -> list[str]:
    """For 4-bit weight-only schemes at the memory shape: is each kernel faster than the reference
    kernel at every M <= 16, and does it hold at most twice the canonical tensors?"""
    from qscheme.catalog import load_scheme
    from qscheme.descriptor.consistency import element_bits

    out: list[str] = []
    for entry in memory:
        scheme = load_scheme(entry.scheme)
        if scheme.weight.blocks is not None:  # packed blocks: the memory table says what they hold
            continue
        if scheme.activation is not None or element_bits(scheme.weight.format) != 4:
            continue
        held = entry.total / entry.canonical
        if entry.kernel == REFERENCE:
            out.append(
                f"- {entry.scheme} {entry.kernel}: holds {held:.2f}x the canonical tensors (no dequantized copy: "
                "it dequantizes chunks of rows at every call)"
            )
            continue
        ratios = [
            (row.m, row.reference_seconds / row.seconds)
            for row in rows
            if (row.scheme, row.kernel, (row.n, row.k)) == (entry.scheme, entry.kernel, shape)
            and row.m <= 16
            and row.reference_seconds
        ]
        faster = "yes" if ratios and min(value for _, value in ratios) > 1 else "NO"
        shown = ", ".join(f"M={m}: {value:.2f}x" for m, value in ratios) or "not measured"
        out.append(
            f"- {entry.scheme} {entry.kernel}: faster than the reference kernel at every M <= 16: {faster} "
            f"({shown}); holds {held:.2f}x the canonical tensors (at most 2x: {'met' if held <= 2 else 'NOT met'})"
        )
    if not out:
        return []
    return ["", f"4-bit weight-only layers at {shape[0]}x{shape[1]}:", *out]


def cpu_name() -> str:
    """The processor's model name (Linux: /proc/cpuinfo), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run(args: argparse.Namespace) -> int:
    thread_counts = args.threads or [torch.get_num_threads()]
    facts = device_facts("cpu", interpreter=False)
    counts = ", ".join(map(str, thread_counts))
    lines = [
        f"CPU: {cpu_name()}, {os.cpu_count()} cores visible, torch {torch.__version__} with {counts} "
        f"thread{'s' if thread_counts != [1] else ''}; bf16 activations.",
        "Times are medians of interleaved rounds (us per call); ratios are how many times faster the kernel is "
        "than bf16 F.linear, fp32 F.linear and the reference kernel, timed in the same rounds.",
    ]
    if args.smoke:
        lines.append("Smoke run: tiny shapes and two rounds, so the times say nothing.")
    print("\n".join(lines) + "\n\n" + "\n".join(markdown_table(HEADER, [])), flush=True)
    rows: list[Row] = []
    checks: list[Check] = []
    memory: list[MemoryRow] = []
    notes: list[str] = []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        for n, k in args.shapes:
            for scheme_name in args.scheme:
                found = measure_scheme(scheme_name, n, k, args, facts)
                rows += found[0]
                checks += found[1]
                memory += found[2] if threads == thread_counts[0] else []
                notes += found[3]
    order = {name: index for index, name in enumerate(args.scheme)}
    rows.sort(key=lambda r: (order.get(r.scheme, len(order)), args.shapes.index((r.n, r.k)), r.threads, r.m))
    checks.sort(key=lambda c: (order.get(c.scheme, len(order)), args.shapes.index((c.n, c.k))))
    n, k = args.memory_shape
    text = [
        *lines,
        "",
        *markdown_table(HEADER, [row.cells() for row in rows]),
        "",
        f"Largest error against the reference kernel at M={CHECK_M} (relative to the largest output; limit "
        f"{ERROR_LIMIT:.1e}):",
        "",
        *markdown_table(("scheme", "kernel", "N x K", "error"), [check.cells() for check in checks]),
    ]
    if memory:
        text += [
            "",
            f"Resident memory of each layer at {n}x{k} after its first forward (its buffers and every tensor its "
            "kernel state holds, each storage once):",
            "",
            *memory_table(memory),
        ]
    text += claims(rows, memory, args.memory_shape)
    if notes:
        text += ["", "Notes:", *(f"- {note}" for note in notes)]
    output = "\n".join(text)
    print("\n" + output)
    if args.markdown:
        Path(args.markdown).write_text(output + "\n", encoding="utf-8")
    bad = [check for check in checks if check.error > ERROR_LIMIT]
    for check in bad:
        print(
            f"cpu_gemm: kernel {check.kernel} disagrees with the reference kernel on {check.scheme} "
            f"{check.n}x{check.k}: {check.error:.2e} > {ERROR_LIMIT:.1e}",
            file=sys.stderr,
        )
    return 1 if bad else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", action="append", help=f"scheme name (repeatable; default: {', '.join(SCHEMES)})")
    parser.add_argument("--kernel", action="append", help="only these kernels (repeatable; default: every runnable)")
    parser.add_argument("--skip", action="append", help="not these kernels (repeatable)")
    parser.add_argument("--shape", action="append", type=parse_shape, help="N x K, e.g. 4096x4096 (repeatable)")
    parser.add_argument("--m", type=int, action="append", dest="m_values", help="rows of the input (repeatable)")
    parser.add_argument(
        "--threads",
        type=int,
        action="append",
        help="torch.set_num_threads, repeatable: one run each (default: torch's)",
    )
    parser.add_argument("--rounds", type=int, help=f"samples per time (default {ROUNDS})")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and few calls: checks the script only")
    parser.add_argument(
        "--gguf", action="store_true", help=f"GGUF block types instead ({', '.join(GGUF_SCHEMES)}; M = 1 and 4)"
    )
    parser.add_argument("--markdown", help="also write the tables to this file")
    args = parser.parse_args(argv)
    args.scheme = args.scheme or list(GGUF_SCHEMES if args.gguf else SCHEMES)
    args.shapes = args.shape or list(SMOKE_SHAPES if args.smoke else SHAPES)
    args.m_values = args.m_values or list(SMOKE_M_VALUES if args.smoke else (GGUF_M_VALUES if args.gguf else M_VALUES))
    args.rounds = args.rounds or (SMOKE_ROUNDS if args.smoke else ROUNDS)
    args.sample_seconds = SMOKE_SAMPLE_SECONDS if args.smoke else SAMPLE_SECONDS
    args.memory_shape = MEMORY_SHAPE if MEMORY_SHAPE in args.shapes else args.shapes[0]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
