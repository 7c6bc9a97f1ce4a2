"""The Triton quantized GEMM against torch's bf16 matmul on a CUDA GPU.

    python benchmarks/gpu_gemm.py [--scheme compressed-tensors/NVFP4A16] [--markdown out.md]
    python benchmarks/gpu_gemm.py --smoke     # CPU, Triton interpreter, tiny shapes

For M in 1, 4, 16, 64, 256 and (N, K) in (4096, 4096), (8192, 8192), (14336, 4096),
(4096, 14336), with bf16 activations: the time of one call of the Triton kernel
(``qscheme.triton.linear.linear``: activation pre-pass if any, GEMM, split-K epilogue if any)
and of ``torch.nn.functional.linear`` with a bf16 weight, their TFLOP/s, the bytes each must
move per call (weights with their scales, input, output) over its time in GB/s, and that
bandwidth as a fraction of the GPU's memory-bandwidth roofline.

Timing: each call is captured in a CUDA graph, replayed over enough distinct copies of the
weights (cycled) that they do not fit in L2, so every call reads its weights from memory and
no launch gaps are counted; the median of 20 replays. The roofline is the GPU's peak memory
bandwidth from a table of known parts (override with --peak-bandwidth GB/s); the bandwidth a
device-to-device copy reaches is printed beside it. Targets checked for NVFP4 weight-only on
H100/H200: at M <= 16 and 8192x8192, at least 2.5x faster than bf16 and 60% of the roofline.

Random weights of the scheme (``qscheme.triton.samples.random_weight``, float scales in bf16
where the scheme allows, as checkpoints keep them) are used: timing does not depend on the
values. Each (N, K) is first checked against the reference kernel at M=16.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton decorates the kernels
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch

M_VALUES = (1, 4, 16, 64, 256)
SHAPES = ((4096, 4096), (8192, 8192), (14336, 4096), (4096, 14336))
SMOKE_M_VALUES = (1, 4)
SMOKE_SHAPES = ((64, 128), (96, 160))
# Peak memory bandwidth in GB/s by device-name fragment (first match wins).
PEAK_BANDWIDTH_GBS = (
    ("H200", 4800.0),
    ("H100 PCIe", 2000.0),
    ("H100 NVL", 3900.0),
    ("H100", 3350.0),
    ("GH200", 4000.0),
    ("B200", 8000.0),
    ("B300", 8000.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
    ("L40S", 864.0),
    ("L40", 864.0),
    ("RTX 4090", 1008.0),
    ("RTX 5090", 1792.0),
)
TARGET_SPEEDUP, TARGET_ROOFLINE = 2.5, 0.60


@dataclass(frozen=True)
class Row:
    m: int
    n: int
    k: int
    triton_s: float
    torch_s: float
    triton_bytes: int
    torch_bytes: int

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k

    def line(self, peak_gbs: float | None) -> str:
        def gbs(nbytes: int, seconds: float) -> float:
            return nbytes / seconds / 1e9

        triton_gbs, torch_gbs = gbs(self.triton_bytes, self.triton_s), gbs(self.torch_bytes, self.torch_s)
        cells = [
            f"{self.m}",
            f"{self.n}x{self.k}",
            f"{self.triton_s * 1e6:.1f}",
            f"{self.torch_s * 1e6:.1f}",
            f"{self.torch_s / self.triton_s:.2f}x",
            f"{self.flops / self.triton_s / 1e12:.2f}",
            f"{self.flops / self.torch_s / 1e12:.2f}",
            f"{triton_gbs:.0f}",
            f"{torch_gbs:.0f}",
        ]
        if peak_gbs:
            cells += [f"{triton_gbs / peak_gbs:.0%}", f"{torch_gbs / peak_gbs:.0%}"]
        return "| " + " | ".join(cells) + " |"


def header(peak_gbs: float | None) -> str:
    names = ["M", "N x K", "triton us", "bf16 us", "speedup", "triton TFLOP/s", "bf16 TFLOP/s"]
    names += ["triton GB/s", "bf16 GB/s"]
    if peak_gbs:
        names += ["triton roofline", "bf16 roofline"]
    return "| " + " | ".join(names) + " |\n|" + "---|" * len(names)


def peak_bandwidth(name: str) -> float | None:
    for fragment, value in PEAK_BANDWIDTH_GBS:
        if fragment.lower() in name.lower():
            return value
    return None


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy (read + write counted)."""
    source = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    seconds = graph_time([lambda: target.copy_(source)])
    return 2 * source.numel() / seconds / 1e9


def graph_time(calls: Sequence[Callable[[], object]], replays: int = 20) -> float:
    """Median seconds per call of ``calls`` run in turn inside one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles, picks configs) outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):  # the warm-up's stream: per-stream state is ready
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e-3 / len(calls))
    return statistics.median(samples)


def copies_for(nbytes: int) -> int:
    """How many distinct copies of a weight make a cycle four times the L2 cache."""
    l2 = int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20))
    return max(1, min(64, math.ceil(4 * l2 / max(1, nbytes))))


def prepared_bytes(prepared: object) -> int:
    tensors = [getattr(prepared, name) for name in ("codes", "scale", "zero_point", "row_scale", "pre_scale")]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def check(scheme: object, n: int, k: int, device: str) -> float:
    """Largest error of the Triton kernel against the reference kernel at M=16, relative to the
    output's largest magnitude."""
    from qscheme_plugins.reference_kernel import ReferenceKernel

    from qscheme.triton.linear import linear, prepare_weight
    from qscheme.triton.samples import model_scale_dtype, random_weight

    scale_dtype = model_scale_dtype(scheme, torch.bfloat16)  # type: ignore[arg-type]
    weight = random_weight(scheme, n, k, seed=1, scale_dtype=scale_dtype)  # type: ignore[arg-type]
    x = torch.randn(16, k, device=device, dtype=torch.bfloat16)
    actual = linear(prepare_weight(weight, device), x).float()
    reference = ReferenceKernel()
    expected = reference.apply(reference.prepare(weight, torch.device(device)), x.float(), None)
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


def run(args: argparse.Namespace) -> int:
    from qscheme.catalog import load_scheme
    from qscheme.triton.linear import linear, prepare_weight
    from qscheme.triton.samples import model_scale_dtype, random_weight

    scheme = load_scheme(args.scheme)
    scale_dtype = model_scale_dtype(scheme, torch.bfloat16)  # float scales as checkpoints keep them
    smoke = args.smoke
    device = "cpu" if smoke else "cuda"
    m_values = SMOKE_M_VALUES if smoke else M_VALUES
    shapes = SMOKE_SHAPES if smoke else SHAPES
    name = "CPU (Triton interpreter)" if smoke else torch.cuda.get_device_name(0)
    peak = None if smoke else (args.peak_bandwidth or peak_bandwidth(name))
    lines = [f"Scheme {scheme.name}, bf16 activations, on {name}."]
    if not smoke:
        lines.append(
            f"Peak memory bandwidth {f'{peak:.0f} GB/s' if peak else 'unknown (pass --peak-bandwidth)'}; "
            f"a 1 GiB device copy reaches {copy_bandwidth():.0f} GB/s."
        )
    else:
        lines.append("Smoke run: interpreted on the CPU, so the times say nothing about a GPU.")
    rows: list[Row] = []
    errors: dict[tuple[int, int], float] = {}
    for n, k in shapes:
        errors[(n, k)] = check(scheme, n, k, device)
        weight = random_weight(scheme, n, k, scale_dtype=scale_dtype)
        prepared = [prepare_weight(weight, device)]
        dense = [torch.randn(n, k, device=device, dtype=torch.bfloat16)]
        if not smoke:  # distinct copies, so each call reads its weights from memory, not L2
            prepared += [prepare_weight(weight, device) for _ in range(copies_for(prepared_bytes(prepared[0])) - 1)]
            dense += [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(copies_for(n * k * 2) - 1)]
        for m in m_values:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            triton_calls = [lambda p=p, x=x: linear(p, x) for p in prepared]
            torch_calls = [lambda w=w, x=x: torch.nn.functional.linear(x, w) for w in dense]
            if smoke:
                triton_s = eager_time(triton_calls)
                torch_s = eager_time(torch_calls)
            else:
                triton_s, torch_s = graph_time(triton_calls), graph_time(torch_calls)
            io_bytes = (m * k + m * n) * 2
            rows.append(Row(m, n, k, triton_s, torch_s, prepared_bytes(prepared[0]) + io_bytes, n * k * 2 + io_bytes))
            print(rows[-1].line(peak), flush=True)
    table = [*lines, "", header(peak), *(row.line(peak) for row in rows), ""]
    table.append(
        "Largest error against the reference kernel at M=16 (relative to the largest output): "
        + ", ".join(f"{n}x{k}: {error:.1e}" for (n, k), error in errors.items())
        + "."
    )
    nvfp4_weight_only = scheme.weight_family == "nvfp4" and scheme.activation is None
    verdicts = targets(rows, peak) if nvfp4_weight_only and not smoke else []
    table += verdicts
    text = "\n".join(table)
    print("\n" + text)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
    worst = max(errors.values())
    if worst > 2.0**-6:
        print(f"gpu_gemm: the Triton kernel disagrees with the reference kernel ({worst:.2e})", file=sys.stderr)
        return 1
    return 0


def eager_time(calls: Sequence[Callable[[], object]]) -> float:
    started = time.perf_counter()
    for call in calls:
        call()
    return (time.perf_counter() - started) / len(calls)


def targets(rows: Sequence[Row], peak: float | None) -> list[str]:
    """The issue's NVFP4 W4A16 targets at 8192x8192, M <= 16."""
    out = ["", f"Targets (8192x8192, M <= 16): >= {TARGET_SPEEDUP}x bf16, >= {TARGET_ROOFLINE:.0%} of the roofline."]
    for row in rows:
        if (row.n, row.k) != (8192, 8192) or row.m > 16:
            continue
        speedup = row.torch_s / row.triton_s
        fraction = row.triton_bytes / row.triton_s / 1e9 / peak if peak else float("nan")
        ok = speedup >= TARGET_SPEEDUP and fraction >= TARGET_ROOFLINE
        out.append(f"- M={row.m}: {speedup:.2f}x, {fraction:.0%} of the roofline: {'met' if ok else 'NOT met'}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", default="compressed-tensors/NVFP4A16", help="scheme name or descriptor file")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under the Triton interpreter")
    parser.add_argument("--peak-bandwidth", type=float, help="the GPU's peak memory bandwidth, GB/s")
    parser.add_argument("--markdown", help="also write the table to this file")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print(
            "gpu_gemm: no CUDA GPU is visible (torch.cuda.is_available() is False), so there is nothing to "
            "measure. Run it on a machine with an NVIDIA GPU, or check the script itself on the CPU with "
            "--smoke (tiny shapes, Triton interpreter).",
            file=sys.stderr,
        )
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
