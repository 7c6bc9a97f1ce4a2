"""Host time per call of the Triton path: what qscheme's Python does around its kernel launches.

    python benchmarks/host_overhead.py [--scheme NAME ...] [--baseline GIT-REV] [--markdown FILE]

A decode step of a 4-bit layer should take 10-15 us on the GPU, so the host code around the
launches must cost a few microseconds, not tens, or an eager (not graph-captured) model is
bound by Python. For each scheme and M this times ``qscheme.triton.linear.linear`` (tile
choice, activation pre-pass set-up, output and split-K buffers, the launches' arguments) on the
CPU with the kernel launches themselves stubbed out (``Launch.run`` records them): Triton's
own launcher, which runs on top of this on a GPU, is not included. No GPU is needed: the
device is described as an H200 so that the host code takes its GPU branches (tiles, split-K).

Beside it, the same machine's time for one eager ``torch.nn.functional.linear`` call on a tiny
bf16 problem (dispatch and a few multiply-adds): the host cost of a dense layer. Also the
wrapper ``QuantLinear.forward`` adds on top of its kernel (input checks, autocast, device and
dtype look-ups), measured with the reference kernel on a tiny layer.

``--baseline REV`` times a git worktree of REV the same way; the two trees run in alternating
subprocesses (best of each), and the table gives the ratio current / baseline (lower is
better). ``--smoke`` runs a few calls only (CI checks that the script works).

``--gpu`` (CUDA only; in scripts/gpu-check.sh) measures what an eager caller sees instead: the
wall time per call of back-to-back calls at M=1, Triton's launcher and the kernels included,
beside eager ``torch.nn.functional.linear`` with a bf16 weight of the same shape.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)  # the GPU host path, not the interpreter's

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SCHEMES = (
    "compressed-tensors/NVFP4A16",
    "compressed-tensors/NVFP4",
    "compressed-tensors/W4A16",
    "compressed-tensors/FP8_DYNAMIC",
)
MS = (1, 16, 256)
N = K = 4096


def best_time(
    call: Callable[[], object], reps: int, rounds: int = 5, finish: Callable[[], object] = lambda: None
) -> float:
    """Microseconds per call: the best of ``rounds`` means over ``reps`` calls, each round
    timed until ``finish()`` returns (a device synchronisation for queued work)."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            call()
        finish()
        best = min(best, (time.perf_counter() - start) / reps * 1e6)
    return best


def measure(schemes: list[str], reps: int) -> dict[str, Any]:
    """Times of this process's qscheme (this tree, or a baseline worktree first on sys.path)."""
    from unittest import mock

    import torch

    from qscheme.catalog import load_scheme
    from qscheme.triton import configs
    from qscheme.triton import linear as triton_linear
    from qscheme.triton.launch import Launch
    from qscheme.triton.samples import model_scale_dtype, random_weight

    assert not triton_linear.interpreted(), "TRITON_INTERPRET must be unset"
    facts = configs.DeviceFacts("NVIDIA H200", 132, 232448, (9, 0))
    launched: list[str] = []

    def record(launch: Launch) -> None:
        launched.append(launch.label)

    rows = []
    with (
        mock.patch.object(triton_linear, "_device_facts", lambda index: facts),
        mock.patch.object(triton_linear, "_device_index", lambda device: 0),
        mock.patch.object(triton_linear, "_capability", lambda index: (9, 0)),
        mock.patch.object(Launch, "run", record),
    ):
        for name in schemes:
            scheme = load_scheme(name)
            weight = random_weight(scheme, N, K, scale_dtype=model_scale_dtype(scheme, torch.bfloat16))
            prepared = triton_linear.prepare_weight(weight, "cpu")
            for m in MS:
                x = torch.randn(m, K, dtype=torch.bfloat16)
                launched.clear()
                triton_linear.linear(prepared, x)  # first call: config chosen, caches filled
                launches = len(launched)
                seconds = best_time(functools.partial(triton_linear.linear, prepared, x), reps)
                rows.append({"scheme": name, "m": m, "launches": launches, "us": seconds})
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    dense = torch.randn(64, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        f_linear = best_time(lambda: torch.nn.functional.linear(x, dense), reps)
    return {"rows": rows, "f_linear_us": f_linear, "wrapper_us": wrapper_time(reps)}


def wrapper_time(reps: int) -> float:
    """What QuantLinear.forward adds to its kernel's apply (reference kernel, tiny layer)."""
    import torch

    from qscheme.catalog import load_scheme
    from qscheme.modules import QuantLinear
    from qscheme.triton.samples import random_weight

    layer = QuantLinear.from_canonical(
        random_weight(load_scheme("compressed-tensors/NVFP4A16"), 16, 64, scale_dtype="bfloat16")
    )
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        layer(x)
        implementation = layer._resolved[layer._default_dtype][2]
        state = layer._states[(layer._default_dtype, layer.kernel.name)]  # per (dtype, kernel of the plan)
        forward = best_time(lambda: layer(x), reps)
        apply = best_time(lambda: implementation.apply(state, x, None), reps)
    return forward - apply


def gpu_eager(schemes: list[str], calls: int = 2000, device: str = "cuda", n: int = N, k: int = K) -> str:
    """Wall time per eager call at M=1 on the GPU (host-bound where the host is the slower), and
    the same calls with the launches stubbed out (``Launch.run`` does nothing): qscheme's host
    code alone on that machine, so that the rest is Triton's launcher and the kernels' queueing.
    ``device`` "cpu" runs it under the interpreter (tests check the table, not the times)."""
    from unittest import mock

    import torch

    from qscheme.catalog import load_scheme
    from qscheme.triton.launch import Launch
    from qscheme.triton.linear import linear, prepare_weight
    from qscheme.triton.samples import model_scale_dtype, random_weight

    def synchronize() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def per_call(call: Callable[[], object]) -> float:
        for _ in range(min(calls, 50)):  # warm-up: compiles, caches, the allocator
            call()
        synchronize()
        return best_time(call, calls, rounds=3, finish=synchronize)

    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    dense = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    torch_us = per_call(functools.partial(torch.nn.functional.linear, x, dense))
    where = torch.cuda.get_device_name(0) if device == "cuda" else "the CPU (Triton interpreter)"
    lines = [
        f"Eager calls at M=1, {n}x{k}, bf16 inputs, on {where}:",
        "",
        "| scheme | qscheme us per call | its host code, launches stubbed | the rest: launcher and kernels "
        "| F.linear us per call | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for name in schemes:
        scheme = load_scheme(name)
        weight = random_weight(scheme, n, k, scale_dtype=model_scale_dtype(scheme, torch.bfloat16))
        prepared = prepare_weight(weight, device)
        call = functools.partial(linear, prepared, x)
        us = per_call(call)
        with mock.patch.object(Launch, "run", lambda launch: None):
            host = per_call(call)
        lines.append(f"| {name} | {us:.1f} | {host:.1f} | {us - host:.1f} | {torch_us:.1f} | {us / torch_us:.2f}x |")
    return "\n".join(lines)


def _subprocess_times(tree: Path, schemes: list[str], reps: int, scratch: str) -> dict[str, Any]:
    environment = dict(os.environ, PYTHONPATH=str(tree))
    environment.pop("TRITON_INTERPRET", None)
    command = [sys.executable, str(Path(__file__).resolve()), "--json", "--reps", str(reps)]
    for name in schemes:
        command += ["--scheme", name]
    completed = subprocess.run(command, env=environment, capture_output=True, text=True, cwd=scratch)
    if completed.returncode != 0:
        raise SystemExit(f"timing {tree} failed:\n{completed.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(completed.stdout)
    return result


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per row, the fastest of the runs (the machines are noisy)."""
    first = runs[0]
    rows = []
    for index, row in enumerate(first["rows"]):
        rows.append({**row, "us": min(run["rows"][index]["us"] for run in runs)})
    return {
        "rows": rows,
        "f_linear_us": min(run["f_linear_us"] for run in runs),
        "wrapper_us": min(run["wrapper_us"] for run in runs),
    }


def compare(schemes: list[str], reps: int, revision: str | None, rounds: int) -> tuple[dict[str, Any], Any]:
    """This tree and (optionally) ``revision``, in alternating subprocesses."""
    with tempfile.TemporaryDirectory() as scratch:
        baseline_tree = Path(scratch) / "baseline"
        if revision is not None:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(baseline_tree), revision], check=True
            )
        try:
            current_runs, baseline_runs = [], []
            for _ in range(rounds):
                current_runs.append(_subprocess_times(ROOT, schemes, reps, scratch))
                if revision is not None:
                    baseline_runs.append(_subprocess_times(baseline_tree, schemes, reps, scratch))
        finally:
            if revision is not None:
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(baseline_tree)], check=False
                )
    return _best(current_runs), (_best(baseline_runs) if baseline_runs else None)


def table(current: dict[str, Any], baseline: dict[str, Any] | None, label: str) -> str:
    header = "| scheme | M | launches | host us per call | x F.linear's |"
    if baseline is not None:
        header += f" {label} us | ratio |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    f_linear = current["f_linear_us"]
    for index, row in enumerate(current["rows"]):
        line = f"| {row['scheme']} | {row['m']} | {row['launches']} | {row['us']:.1f} | {row['us'] / f_linear:.1f}x |"
        if baseline is not None:
            old = baseline["rows"][index]
            line += f" {old['us']:.1f} | {row['us'] / old['us']:.2f}x |"
        lines.append(line)
    lines.append("")
    lines.append(f"Eager torch.nn.functional.linear, bf16 1x64 @ 64x64, on this CPU: {f_linear:.1f} us per call.")
    wrapper = f"QuantLinear.forward around its kernel: {current['wrapper_us']:.1f} us"
    if baseline is not None:
        wrapper += f" ({label}: {baseline['wrapper_us']:.1f} us)"
    lines.append(wrapper + ".")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", action="append", default=[])
    parser.add_argument("--reps", type=int, default=2000, help="calls per timing round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating subprocess runs per tree")
    parser.add_argument("--baseline", help="git revision to compare with (a worktree)")
    parser.add_argument("--markdown", help="also write the table to this file")
    parser.add_argument("--json", action="store_true", help="time this process's qscheme, print JSON")
    parser.add_argument("--smoke", action="store_true", help="a few calls per timing (checks the script)")
    parser.add_argument("--gpu", action="store_true", help="eager wall time per call on a CUDA GPU")
    args = parser.parse_args(argv)
    schemes = args.scheme or list(DEFAULT_SCHEMES)
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            print("host_overhead --gpu needs a CUDA GPU; without one, run it without --gpu", file=sys.stderr)
            return 2
        text = gpu_eager(schemes)
    elif args.json:
        print(json.dumps(measure(schemes, args.reps)))
        return 0
    else:
        reps, rounds = (5, 1) if args.smoke else (args.reps, args.rounds)
        current, baseline = compare(schemes, reps, args.baseline, rounds)
        text = table(current, baseline, f"baseline {args.baseline}")
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
