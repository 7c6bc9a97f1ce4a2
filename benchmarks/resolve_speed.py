"""Resolution speed: every linear of a 70B-like model (80 blocks x 7 linears + fused qkv and gate_up).

    python benchmarks/resolve_speed.py [--calls 10000] [--device sm100]

Times 10,000 resolutions, cycling over the layers and three schemes, through
1. ``registry.resolve_layer`` (what QuantLinear and the checkpoint loader call: the memoising
   resolver for the device, kernels and overrides; the target is under 100 ms in total),
2. one ``Resolver`` held by the caller (the same memo without the per-call lookup),
3. the pure ``resolve`` with no memo at all (every candidate judged on every call).
Plugin loading, device probing and the import of the chosen kernels' code happen once, before timing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

from qscheme.catalog import load_catalog
from qscheme.descriptor import Scheme
from qscheme.kernels import registry
from qscheme.kernels.problem import Problem
from qscheme.kernels.resolver import Resolver, resolve

sys.path.insert(0, os.path.dirname(__file__))
from llama_shapes import block_linears

HIDDEN, INTERMEDIATE, KV = 8192, 28672, 1024
BLOCKS = 80
SCHEMES = ("compressed-tensors/NVFP4", "compressed-tensors/W4A16", "modelopt/FP8")


def layout() -> list[Problem]:
    """The linears of a Llama-3-70B-shaped model, each fused variant with per-partition scales."""
    problems: list[Problem] = []
    shapes = block_linears(HIDDEN, KV, INTERMEDIATE)
    for block in range(BLOCKS):
        prefix = f"model.layers.{block}"
        problems.extend(Problem(n, k, layer=f"{prefix}.{name}") for name, (n, k) in shapes.items())
        problems.append(
            Problem(
                HIDDEN + 2 * KV,
                HIDDEN,
                partitions=3,
                partition_scales_differ=True,
                layer=f"{prefix}.self_attn.qkv_proj",
            )
        )
        problems.append(
            Problem(
                2 * INTERMEDIATE, HIDDEN, partitions=2, partition_scales_differ=True, layer=f"{prefix}.mlp.gate_up_proj"
            )
        )
    return problems


def timed(calls: list[tuple[Scheme, Problem]], run: Callable[[Scheme, Problem], object]) -> float:
    start = time.perf_counter()
    for scheme, problem in calls:
        run(scheme, problem)
    return (time.perf_counter() - start) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--device", default="sm100")
    args = parser.parse_args()

    catalog = load_catalog()
    schemes = [catalog.get(name) for name in SCHEMES]
    problems = layout()
    # Each scheme in turn over the whole layout (as loading three checkpoints would), 10,000 calls.
    calls = [(schemes[(i // len(problems)) % len(schemes)], problems[i % len(problems)]) for i in range(args.calls)]
    device = registry.device_for(args.device)
    declarations = registry.declarations()
    held = Resolver(device, declarations)
    # The chosen kernels' code is imported once per process, by the first layer that picks each
    # (as plugin loading and device probing, a one-time cost): done before timing.
    for scheme in schemes:
        registry.resolve_layer(scheme, problems[0], device)

    edge_ms = timed(calls, lambda scheme, problem: registry.resolve_layer(scheme, problem, device))
    held_ms = timed(calls, held.resolve)
    pure_ms = timed(calls, lambda scheme, problem: resolve(scheme, problem, device, declarations))
    unique = len({(scheme.name, problem) for scheme, problem in calls})
    print(
        f"layout: {BLOCKS} blocks x 7 linears + fused qkv and gate_up = {len(problems)} layers; "
        f"{len(SCHEMES)} schemes; {len(declarations)} kernels; device {device.label}"
    )
    print(f"{args.calls} resolutions ({unique} distinct scheme/shape problems):")
    print(
        f"  registry.resolve_layer (memoised, as QuantLinear uses it): {edge_ms:8.1f} ms total, "
        f"{edge_ms * 1000 / args.calls:6.2f} us per call"
    )
    print(
        f"  held Resolver (memoised):                                 {held_ms:8.1f} ms total, "
        f"{held_ms * 1000 / args.calls:6.2f} us per call"
    )
    print(
        f"  pure resolve (no memo):                                   {pure_ms:8.1f} ms total, "
        f"{pure_ms * 1000 / args.calls:6.2f} us per call"
    )
    verdict = "PASS" if edge_ms < 100 else "FAIL"
    print(f"target: under 100 ms for {args.calls} calls through registry.resolve_layer: {verdict}")


if __name__ == "__main__":
    main()
