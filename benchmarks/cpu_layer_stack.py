"""Decode's layer calls from memory: a Llama-shaped stack of distinct layers per kernel, one run.

    python benchmarks/cpu_layer_stack.py [--scheme gguf/Q4_0] [--kernel NAME ...] [--layers 16] [--threads 2]
    python benchmarks/cpu_layer_stack.py --scheme gguf/Q6_K --switch QSCHEME_CPU_GEMV_BF16DOT
    python benchmarks/cpu_layer_stack.py --smoke     # tiny shapes, two rounds (the test's run)

``cpu_gemm.py`` times one layer called again and again. A 4-bit 4096x4096 weight (9.4 MB) then
stays in a 32 MiB last-level cache while bf16's (33.5 MB) does not, and the loops never start
cold. Decoding a model reads every layer once per token, from memory. This script builds the
projections of ``--layers`` Llama blocks (hidden 2048, intermediate 8192, 8 KV heads of 64:
q/o 2048x2048, k/v 512x2048, gate/up 8192x2048, down 2048x8192), each layer with its own copy of
the weight, for every kernel the resolver accepts for the scheme on this CPU (or ``--kernel``;
the reference kernel and ``dequant_gemm``, which dequantize at every call, only when named),
beside bf16 ``F.linear`` over distinct dense weights of the same shapes. At 16 blocks the 4-bit
stack holds about 550 MB, far beyond any cache.

One bf16 row of x per call (M = 1). Each stack runs in turn within a round (the order rotating),
its time the median over ``--rounds`` rounds; per shape, the median time of one call over the
rounds. Reported: ms per stack, the ratio to bf16 ``F.linear`` and to the first kernel (above 1:
faster), GB/s (the bytes each kernel state holds over the stack's time) and us per call per
shape. ``--switch VAR`` (repeatable) adds, for each kernel, a row of the same stack run with the
environment variable VAR set to 0 while it runs (the extension's loop switches, such as
``QSCHEME_CPU_GEMV_BF16DOT`` or ``QSCHEME_CPU_GEMV_PLANES64``, are read at each call), in the same
rounds. The weights are GGUF blocks quantized by qscheme's GGUF quantizer (a 64-row slab repeated
down N) or ``qscheme.triton.samples.random_weight``; the times do not depend on the values.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # kernel_table, beside this script

from kernel_table import build_layer, device_facts, markdown_table, ratio, runnable_kernels, state_bytes

from qscheme.canonical import CanonicalWeight
from qscheme.catalog import load_scheme

SHAPES = ((2048, 2048), (512, 2048), (512, 2048), (2048, 2048), (8192, 2048), (8192, 2048), (2048, 8192))
SMOKE_SHAPES = ((128, 256), (64, 256), (64, 256), (128, 256), (256, 256), (256, 256), (128, 512))
SLAB_ROWS = 64
DENSE = "F.linear bf16"
SLOW = ("reference", "dequant_gemm")  # not decode kernels: they dequantize the weight at every call


def sample_weight(scheme_name: str, n: int, k: int) -> CanonicalWeight:
    """A canonical weight [n, k] of the scheme (GGUF blocks of a quantized random slab, or random codes)."""
    scheme = load_scheme(scheme_name)
    if scheme.weight.blocks is not None:
        from qscheme.canonical_blocks import canonical_blocks
        from qscheme.producers.gguf.quants.api import quantize_blocks

        dense = torch.randn(min(n, SLAB_ROWS), k, generator=torch.Generator().manual_seed(1))
        raw = quantize_blocks(dense, scheme.name.removeprefix("gguf/"))
        return canonical_blocks(scheme, raw.repeat(-(-n // raw.shape[0]), 1)[:n].contiguous(), n, k)
    from qscheme.triton.samples import model_scale_dtype, random_weight

    return random_weight(scheme, n, k, seed=1, scale_dtype=model_scale_dtype(scheme, torch.bfloat16))


def copy_of(weight: CanonicalWeight) -> CanonicalWeight:
    """The same weight in tensors of its own (a layer's own memory)."""
    fields = {f.name: getattr(weight, f.name) for f in dataclasses.fields(weight)}
    return dataclasses.replace(weight, **{k: v.clone() for k, v in fields.items() if isinstance(v, torch.Tensor)})


@contextlib.contextmanager
def switched_off(variable: str | None) -> Iterator[None]:
    """``variable`` set to 0 while the block runs (nothing for None), then as it was."""
    if variable is None:
        yield
        return
    before = os.environ.get(variable)
    os.environ[variable] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[variable]
        else:
            os.environ[variable] = before


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", default="gguf/Q4_0")
    parser.add_argument(
        "--kernel", action="append", help="repeatable; default: every kernel accepted here but " + ", ".join(SLOW)
    )
    parser.add_argument("--layers", type=int, default=16, help="Llama blocks (7 projections each)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, 2 blocks, 2 rounds")
    parser.add_argument(
        "--switch", action="append", default=[], metavar="VAR",
        help="repeatable: also run each kernel's stack with this environment variable set to 0",
    )  # fmt: skip
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    layers, rounds = (2, 2) if args.smoke else (args.layers, args.rounds)
    before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return run(args.scheme, args.kernel or (), shapes, layers, rounds, args)
    finally:
        torch.set_num_threads(before)


def run(
    scheme_name: str, only: Sequence[str], shapes: Sequence[tuple[int, int]], blocks: int, rounds: int,
    args: argparse.Namespace,
) -> int:  # fmt: skip
    facts = device_facts("cpu", interpreter=False)
    weights = {shape: sample_weight(scheme_name, *shape) for shape in set(shapes)}
    kernels = runnable_kernels(weights[shapes[0]], facts, only=only, skip=() if only else SLOW).kernels
    if not kernels:
        print(f"cpu_layer_stack: no kernel runs {scheme_name} on this CPU", file=sys.stderr)
        return 1
    generator = torch.Generator().manual_seed(2)
    stacks: dict[str, list[tuple[tuple[int, int], Callable[[torch.Tensor], object]]]] = {DENSE: []}
    held: dict[str, int] = defaultdict(int)
    for _ in range(blocks):
        for n, k in shapes:
            dense = torch.randn(n, k, generator=generator).to(torch.bfloat16)
            stacks[DENSE].append(((n, k), lambda x, w=dense: F.linear(x, w)))
            held[DENSE] += dense.numel() * 2
    switched: dict[str, str] = {}  # row name: the variable set to 0 while it runs
    for kernel in kernels:
        stacks[kernel] = []
        for _ in range(blocks):
            for shape in shapes:
                layer = build_layer(copy_of(weights[shape]), kernel, "cpu", facts)
                stacks[kernel].append((shape, layer))
                held[kernel] += state_bytes(layer)
        for variable in args.switch:
            name = f"{kernel} ({variable}=0)"
            stacks[name], held[name], switched[name] = stacks[kernel], held[kernel], variable
    inputs = {k: torch.randn(1, k, generator=generator).to(torch.bfloat16) for k in {k for _, k in shapes}}
    per_call: dict[tuple[str, tuple[int, int]], list[float]] = defaultdict(list)
    totals: dict[str, list[float]] = defaultdict(list)

    def run_stack(name: str, record: bool) -> None:
        with switched_off(switched.get(name)):
            started = time.perf_counter()
            for shape, call in stacks[name]:
                begun = time.perf_counter()
                call(inputs[shape[1]])
                if record:
                    per_call[(name, shape)].append(time.perf_counter() - begun)
            if record:
                totals[name].append(time.perf_counter() - started)

    names = list(stacks)
    with torch.inference_mode():
        for name in names:
            run_stack(name, record=False)  # warm-up: prepares every kernel state
        for index in range(rounds):
            for name in names[index % len(names) :] + names[: index % len(names)]:
                run_stack(name, record=True)
    seconds = {name: statistics.median(totals[name]) for name in names}
    first = kernels[0]
    ordered = sorted(set(shapes))
    header = ["kernel", "ms / stack", "vs bf16 F.linear", f"vs {first}", "GB/s", "MB held"]
    header += [f"{n}x{k} us" for n, k in ordered]
    rows = []
    for name in names:
        cells = [name, f"{seconds[name] * 1e3:.2f}", ratio(seconds[DENSE], seconds[name])]
        cells += [ratio(seconds[first], seconds[name]) if name != DENSE else "-"]
        cells += [f"{held[name] / seconds[name] / 1e9:.1f}", f"{held[name] / 1e6:.1f}"]
        cells += [f"{statistics.median(per_call[(name, shape)]) * 1e6:.1f}" for shape in ordered]
        rows.append(cells)
    lines = [
        f"{scheme_name}: {blocks} Llama blocks of {len(shapes)} projections, each layer its own weight; M = 1, bf16 "
        f"x, {torch.get_num_threads()} threads, medians of {rounds} interleaved rounds.",
        "",
        *markdown_table(header, rows),
    ]
    if args.smoke:
        lines.append("Smoke run: tiny shapes and two rounds, so the times say nothing.")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
