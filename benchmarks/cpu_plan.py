"""Where a layer's kernel should change with the batch size M: the measurement behind batch ranges.

    python benchmarks/cpu_plan.py [--scheme NAME ...] [--threads 1,2] [--m 1,2,4,...] [--shape 4096x4096]
    python benchmarks/cpu_plan.py --smoke     # tiny shapes, a few calls

For each scheme, every kernel the resolver accepts for it on this CPU (forced, one layer each,
built from the same random canonical weight), the tile GEMM ``dequant_gemm`` among them, and the
layer as its plan runs it (no kernel forced: the kernel ``qscheme resolve --m`` names for each
M), are timed beside ``torch.nn.functional.linear`` on a dense bfloat16 weight, with bfloat16
inputs, for M from 1 to 256 and each thread count. Times are medians of interleaved rounds
(``kernel_table.interleaved_medians``); the ratio is bf16 ``F.linear``'s time over the kernel's
(above 1: faster than bf16). For each scheme and thread count the run ends with the smallest M
from which ``dequant_gemm`` is faster than every other accepted kernel at every larger M
measured: the boundary a declaration's ``BatchRange`` states (with this script as its source).

Memory: after a forward at every M, the distinct storages of the plan layer's buffers and of
every prepared kernel state (``kernel_table.resident_bytes``), as a multiple of the canonical
tensors: kernels that keep the canonical tensors add nothing.

    python benchmarks/cpu_plan.py --summary [--runs 2] [--scheme NAME ...]   # the large-M table

``--summary``: only the layer as its plan runs it (no kernel forced) against bf16 ``F.linear``,
for every scheme of ``SUMMARY_SCHEMES`` (the CPU's weight-only and quantized-activation schemes),
M = 16, 64 and 256, 4096x4096 and 14336x4096, 1 and 2 threads, the whole sweep ``--runs`` times;
it ends with one markdown table (ratio ranges over the runs, the plan's kernel, the layer's
resident memory over its canonical tensors) and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # kernel_table, beside this script

from kernel_table import (
    build_layer,
    canonical_bytes,
    device_facts,
    interleaved_medians,
    parse_shape,
    resident_bytes,
    runnable_kernels,
)

SCHEMES = ("compressed-tensors/NVFP4A16", "compressed-tensors/W4A16", "compressed-tensors/W8A16_G32")
M_VALUES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
THREADS = (1, 2)
SHAPE = (4096, 4096)
PLAN = "plan"
LARGE_M_KERNEL = "dequant_gemm"
ROUNDS, SAMPLE_SECONDS, BUDGET_SECONDS = 5, 0.02, 2.5
SUMMARY_SCHEMES = (
    "compressed-tensors/NVFP4A16",
    "compressed-tensors/MXFP4A16",
    "compressed-tensors/W4A16",
    "modelopt/W4A16_AWQ",
    "compressed-tensors/W8A16_G32",
    "modelopt/fp8_pb_wo",
    "compressed-tensors/FP8_DYNAMIC",
    "bitsandbytes/NF4_DQ",
)
SUMMARY_M = (16, 64, 256)
SUMMARY_SHAPES = ((4096, 4096), (14336, 4096))


def measure(
    scheme_name: str, n: int, k: int, m_values: Sequence[int], rounds: int, sample_seconds: float
) -> tuple[dict[int, dict[str, float]], list[str], float]:
    """{M: {peer: seconds}}, the plan's kernel for each M, and the plan layer's resident memory
    over its canonical tensors."""
    from qscheme.catalog import load_scheme
    from qscheme.modules import QuantLinear
    from qscheme.triton.samples import model_scale_dtype, random_weight

    facts = device_facts("cpu", False)
    scheme = load_scheme(scheme_name)
    weight = random_weight(scheme, n, k, seed=1, scale_dtype=model_scale_dtype(scheme, torch.bfloat16))
    from qscheme.kernels import registry
    from qscheme.plugins.manager import BUILTIN_PLUGINS

    third_party = [d.name for d in registry.declarations() if d.plugin not in BUILTIN_PLUGINS]
    runnable = runnable_kernels(weight, facts, skip=third_party)  # the built-in kernels only
    layers = {name: build_layer(weight, name, "cpu", facts) for name in runnable.kernels}
    plan_layer = QuantLinear(weight, "cpu", device_facts=facts)
    layers[PLAN] = plan_layer
    generator = torch.Generator().manual_seed(2)
    dense = torch.randn(n, k, generator=generator).to(torch.bfloat16)
    times: dict[int, dict[str, float]] = {}
    routes = []
    for m in m_values:
        x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
        calls: dict[str, Callable[[], object]] = {"F.linear bf16": lambda x=x: F.linear(x, dense)}
        for name, layer in layers.items():
            calls[name] = lambda layer=layer, x=x: layer(x)
        with torch.inference_mode():
            times[m] = interleaved_medians(calls, rounds, sample_seconds, 1, BUDGET_SECONDS)
        routes.append(f"M={m}: {plan_layer.kernel_for_batch(m).name}")
    memory = sum(resident_bytes(plan_layer).values()) / canonical_bytes(plan_layer)
    return times, routes, memory


def boundary(times: dict[int, dict[str, float]]) -> int | None:
    """The smallest measured M from which ``dequant_gemm`` beats every other kernel at every
    larger measured M (None: it never does)."""
    found = None
    for m in sorted(times, reverse=True):
        row = times[m]
        others = [t for name, t in row.items() if name not in (LARGE_M_KERNEL, PLAN, "F.linear bf16")]
        if LARGE_M_KERNEL not in row or any(t <= row[LARGE_M_KERNEL] for t in others):
            break
        found = m
    return found


def run(args: argparse.Namespace) -> int:
    n, k = args.shape
    for threads in args.threads:
        torch.set_num_threads(threads)
        for scheme in args.scheme:
            times, routes, memory = measure(scheme, n, k, args.m_values, args.rounds, args.sample_seconds)
            peers = [name for name in next(iter(times.values())) if name != "F.linear bf16"]
            print(f"\n## {scheme}, {n}x{k}, bf16 inputs, {threads} thread(s)")
            print("| M | F.linear bf16 us | " + " | ".join(f"{p} us (x bf16)" for p in peers) + " |")
            print("|---" * (2 + len(peers)) + "|")
            for m, row in times.items():
                base = row["F.linear bf16"]
                cells = [f"{row[p] * 1e6:.0f} ({base / row[p]:.2f}x)" for p in peers]
                print(f"| {m} | {base * 1e6:.0f} | " + " | ".join(cells) + " |")
            print(f"plan: {'; '.join(routes)}")
            print(f"plan layer resident after every M: {memory:.2f}x its canonical tensors")
            found = boundary(times)
            print(
                f"{LARGE_M_KERNEL} beats every other kernel from M = {found} on"
                if found
                else f"{LARGE_M_KERNEL} never beats every other kernel over the M measured"
            )
    return 0


def plan_times(
    scheme_name: str, n: int, k: int, m_values: Sequence[int], rounds: int, sample_seconds: float
) -> tuple[dict[int, tuple[float, float]], dict[int, str], float]:
    """{M: (bf16 F.linear seconds, plan layer seconds)}, the plan's kernel per M, and the layer's
    resident memory over its canonical tensors after a forward at every M."""
    from qscheme.catalog import load_scheme
    from qscheme.modules import QuantLinear
    from qscheme.triton.samples import model_scale_dtype, random_weight

    scheme = load_scheme(scheme_name)
    weight = random_weight(scheme, n, k, seed=1, scale_dtype=model_scale_dtype(scheme, torch.bfloat16))
    layer = QuantLinear(weight, "cpu", device_facts=device_facts("cpu", False))
    generator = torch.Generator().manual_seed(2)
    dense = torch.randn(n, k, generator=generator).to(torch.bfloat16)
    times, kernels = {}, {}
    for m in m_values:
        x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
        calls: dict[str, Callable[[], object]] = {"bf16": lambda x=x: F.linear(x, dense), PLAN: lambda x=x: layer(x)}
        with torch.inference_mode():
            row = interleaved_medians(calls, rounds, sample_seconds, 1, BUDGET_SECONDS)
        times[m] = (row["bf16"], row[PLAN])
        kernels[m] = layer.kernel_for_batch(m).name
    memory = sum(resident_bytes(layer).values()) / canonical_bytes(layer)
    return times, kernels, memory


def summary(args: argparse.Namespace) -> int:
    """The large-M table (see the module docstring: --summary)."""
    load_before = os.getloadavg()
    ratios: dict[tuple[str, str, int, int], list[float]] = {}
    kernels: dict[tuple[str, str, int, int], str] = {}
    memory: dict[str, float] = {}
    for run_index in range(args.runs):
        for threads in args.threads:
            torch.set_num_threads(threads)
            for scheme in args.scheme:
                for n, k in args.shapes:
                    times, chosen, held = plan_times(scheme, n, k, args.m_values, args.rounds, args.sample_seconds)
                    memory[scheme] = max(memory.get(scheme, 0.0), held)
                    for m, (bf16, plan) in times.items():
                        key = (scheme, f"{n}x{k}", threads, m)
                        ratios.setdefault(key, []).append(bf16 / plan)
                        kernels[key] = chosen[m]
                        print(
                            f"run {run_index + 1} {scheme} {n}x{k} {threads} thread(s) M={m}: bf16 F.linear "
                            f"{bf16 * 1e3:.2f} ms, plan ({chosen[m]}) {plan * 1e3:.2f} ms: {bf16 / plan:.2f}x",
                            flush=True,
                        )
    load_after = os.getloadavg()
    header = ["scheme", "layer", "threads", *(f"M = {m} (x bf16)" for m in args.m_values), "kernel", "resident"]
    print(f"\n## the plan layer against bf16 F.linear, bf16 inputs, {args.runs} run(s): ranges of same-run ratios")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for scheme in args.scheme:
        for n, k in args.shapes:
            for threads in args.threads:
                cells = []
                for m in args.m_values:
                    values = ratios[(scheme, f"{n}x{k}", threads, m)]
                    low, high = min(values), max(values)
                    cells.append(f"{low:.2f}x" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}x")
                names = sorted({kernels[(scheme, f"{n}x{k}", threads, m)] for m in args.m_values})
                row = [scheme, f"{n}x{k}", str(threads), *cells, ", ".join(names), f"{memory[scheme]:.2f}x"]
                print("| " + " | ".join(row) + " |")
    print(
        f"load average (1, 5, 15 min) before: {', '.join(f'{v:.1f}' for v in load_before)}; "
        f"after: {', '.join(f'{v:.1f}' for v in load_after)}; {os.cpu_count()} CPUs"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheme", action="append", default=None)
    parser.add_argument("--threads", default=",".join(str(t) for t in THREADS))
    parser.add_argument("--m", default=",".join(str(m) for m in M_VALUES))
    parser.add_argument("--shape", default=f"{SHAPE[0]}x{SHAPE[1]}")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, a few calls")
    parser.add_argument("--summary", action="store_true", help="the plan layer only, M = 16, 64, 256, two shapes")
    parser.add_argument("--runs", type=int, default=2, help="--summary: sweeps (ranges over them)")
    args = parser.parse_args(argv)
    args.scheme = args.scheme or list(SUMMARY_SCHEMES if args.summary else SCHEMES)
    args.threads = [int(t) for t in args.threads.split(",")]
    args.m_values = [int(m) for m in args.m.split(",")]
    args.shape = parse_shape(args.shape)
    args.rounds, args.sample_seconds = ROUNDS, SAMPLE_SECONDS
    if args.summary:
        explicit = argv is not None and any(a.startswith(("--m", "--shape")) for a in argv)
        args.shapes = [args.shape] if explicit else list(SUMMARY_SHAPES)
        args.m_values = args.m_values if explicit else list(SUMMARY_M)
    if args.smoke:
        args.shape, args.m_values, args.threads, args.rounds, args.sample_seconds = (128, 256), [1, 16], [1], 2, 0.0
        args.shapes, args.runs = [args.shape], 1
    return summary(args) if args.summary else run(args)


if __name__ == "__main__":
    raise SystemExit(main())
