"""Every kernel that runs a scheme on a CUDA GPU, side by side with torch's bf16 matmul.

    python benchmarks/gpu_gemm.py [--scheme compressed-tensors/NVFP4A16 ...] [--markdown out.md]
    python benchmarks/gpu_gemm.py --smoke     # CPU, Triton interpreter, tiny shapes

For each scheme (default: compressed-tensors NVFP4A16, NVFP4, W4A16, FP8, FP8_DYNAMIC,
FP8_BLOCK, ModelOpt FP8 and W4A16_AWQ; ``--scheme`` repeatable) the resolver lists the kernels
that accept the layer on this GPU (every accepted one, not only the one it would choose; no
kernel name is written here, so a kernel a plugin adds is measured once installed). Each runs a
``QuantLinear`` built from random weights of the scheme (``qscheme.triton.samples.random_weight``,
float scales in bf16 where the scheme allows, as checkpoints keep them) with that kernel forced,
first checked against the reference kernel at M=16 (largest error relative to the largest
output; a kernel further than 2**-6 fails the run).

For M in 1, 4, 16, 64, 256 and (N, K) in (4096, 4096), (8192, 8192), (14336, 4096),
(4096, 14336), with bf16 activations: the time of one forward call of each kernel's layer and of
``torch.nn.functional.linear`` with a bf16 weight, how many times faster the kernel is than that
and than the ``triton`` kernel, its TFLOP/s, the bytes it must move per call (the tensors of its
prepared state: weights with their scales; the input; the output) over its time in GB/s, and
that bandwidth as a fraction of the GPU's memory-bandwidth roofline.

Timing: each call is captured in a CUDA graph, replayed over enough distinct copies of the
layer (cycled) that their weights do not fit in L2, so every call reads its weights from memory
and no launch gaps are counted; the median of 20 replays. A kernel whose calls cannot be
captured is timed eagerly with CUDA events instead (launch gaps included) and marked so. The
roofline is the GPU's peak memory bandwidth from a table of known parts (override with
--peak-bandwidth GB/s); the bandwidth a device-to-device copy reaches is printed beside it.
Targets checked for NVFP4 weight-only on H100/H200: at M <= 16 and 8192x8192, at least 2.5x
faster than bf16 and 60% of the roofline.

Memory: for each (scheme, kernel) at 4096x4096 after the first forward, what the layer holds
in host memory (its canonical tensors) and on the GPU (its kernel state), as with
``cpu_gemm.py``.

Two rows besides the resolver's kernels:

- ``gemlite``: GemLite 0.6 (``pip install gemlite``, or the wheel ``scripts/build-gemlite-wheel.sh``
  builds from its pure-Python sdist) on int4 / uint4 group-scaled weight-only schemes (W4A16,
  W4A16_ASYM), through its public API (``gemlite.helper.A16Wn(...).from_weights``: codes 0..15,
  scales and zero points per group, ``(W_q - zeros) * scales``), from the same weight; skipped
  with the reason in the notes where gemlite does not import, there is no GPU, or the scheme is
  not one it runs (``--no-gemlite`` leaves it out);
- ``triton (gemv)``: the Triton kernel with ``QSCHEME_TRITON_GEMV=1`` at M <= 4, where the
  heuristic then takes the CUDA-core GEMV instead of its default GEMM tile: the two side by side.
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
from pathlib import Path

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton decorates the kernels
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # kernel_table, beside this script

from kernel_table import (
    MemoryRow,
    build_layer,
    device_facts,
    markdown_table,
    memory_row,
    memory_table,
    parse_shape,
    ratio,
    reference_output,
    relative_error,
    runnable_kernels,
    state_bytes,
)

from qscheme.triton.configs import GEMV_MAX_M
from qscheme.triton.linear import GEMV_VARIABLE

SCHEMES = (
    "compressed-tensors/NVFP4A16",
    "compressed-tensors/NVFP4",
    "compressed-tensors/W4A16",
    "compressed-tensors/FP8",
    "compressed-tensors/FP8_DYNAMIC",
    "compressed-tensors/FP8_BLOCK",
    "modelopt/FP8",
    "modelopt/W4A16_AWQ",
)
M_VALUES = (1, 4, 16, 64, 256)
SHAPES = ((4096, 4096), (8192, 8192), (14336, 4096), (4096, 14336))
MEMORY_SHAPE = (4096, 4096)
SMOKE_SCHEMES = ("compressed-tensors/NVFP4A16", "compressed-tensors/W4A16", "compressed-tensors/FP8_DYNAMIC")
SMOKE_M_VALUES = (1, 4)
SMOKE_SHAPES = ((64, 128), (96, 160))
CHECK_M = 16
ERROR_LIMIT = 2.0**-6
TRITON = "triton"  # the peer of the "vs triton" column (plugins/triton_declaration.py)
GEMLITE = "gemlite"
TRITON_GEMV = "triton (gemv)"
REFERENCE = "reference"
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
    scheme: str
    kernel: str
    m: int
    n: int
    k: int
    seconds: float
    torch_s: float
    moved_bytes: int
    torch_bytes: int
    triton_s: float | None = None
    eager: bool = False  # timed without a CUDA graph (its capture failed): launch gaps included

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k

    def cells(self, peak_gbs: float | None) -> list[str]:
        gbs, torch_gbs = self.moved_bytes / self.seconds / 1e9, self.torch_bytes / self.torch_s / 1e9
        cells = [
            self.scheme,
            self.kernel + (" (eager)" if self.eager else ""),
            f"{self.n}x{self.k}",
            f"{self.m}",
            f"{self.seconds * 1e6:.1f}",
            f"{self.torch_s * 1e6:.1f}",
            ratio(self.torch_s, self.seconds),
            ratio(self.triton_s, self.seconds),
            f"{self.flops / self.seconds / 1e12:.2f}",
            f"{gbs:.0f}",
            f"{torch_gbs:.0f}",
        ]
        if peak_gbs:
            cells += [f"{gbs / peak_gbs:.0%}", f"{torch_gbs / peak_gbs:.0%}"]
        return cells

    def line(self, peak_gbs: float | None) -> str:
        return "| " + " | ".join(self.cells(peak_gbs)) + " |"


def header(peak_gbs: float | None) -> list[str]:
    names = ["scheme", "kernel", "N x K", "M", "us", "bf16 us", "vs bf16", "vs triton", "TFLOP/s", "GB/s"]
    names += ["bf16 GB/s"]
    if peak_gbs:
        names += ["roofline", "bf16 roofline"]
    return names


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


def event_time(calls: Sequence[Callable[[], object]], replays: int = 20) -> float:
    """Median seconds per call of ``calls`` run eagerly in turn (launch gaps included)."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for call in calls:
            call()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e-3 / len(calls))
    return statistics.median(samples)


def eager_time(calls: Sequence[Callable[[], object]]) -> float:
    started = time.perf_counter()
    for call in calls:
        call()
    return (time.perf_counter() - started) / len(calls)


def timed(calls: Sequence[Callable[[], object]], smoke: bool) -> tuple[float, bool]:
    """Seconds per call, and whether it was timed eagerly because the calls could not be captured."""
    if smoke:
        return eager_time(calls), False
    try:
        return graph_time(calls), False
    except Exception as error:  # a kernel that syncs or allocates host memory cannot be captured
        print(f"gpu_gemm: CUDA graph capture failed ({type(error).__name__}: {error}); timing eagerly", flush=True)
        torch.cuda.synchronize()
        return event_time(calls), True


def copies_for(nbytes: int) -> int:
    """How many distinct copies of a weight make a cycle four times the L2 cache."""
    l2 = int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20))
    return max(1, min(64, math.ceil(4 * l2 / max(1, nbytes))))


def prepared_bytes(prepared: object) -> int:
    """Bytes of a Triton ``PreparedWeight``'s weight tensors (triton_stream.py and triton_sweep.py)."""
    tensors = [getattr(prepared, name) for name in ("codes", "scale", "zero_point", "row_scale", "pre_scale")]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def gemlite_operands(weight: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | str:
    """GemLite's A16W4 operands for a canonical int4 / uint4 group-scaled weight-only layer:
    (codes 0..15 as uint8 [N, K], scales [N, K/g], zero points [N, K/g], g), dequantizing as
    ``(codes - zeros) * scales`` to the canonical weight; or why the layer is not one GemLite runs."""
    from qscheme.canonical import CanonicalWeight

    assert isinstance(weight, CanonicalWeight)
    scheme = weight.scheme
    spec = scheme.weight
    if scheme.activation is not None or spec.format not in ("int4", "uint4") or spec.scale.granularity != "group":
        return f"{scheme.name}: GemLite's A16W4 takes int4 / uint4 group-scaled weight-only layers"
    group = int(spec.scale.group_size or 0)
    if weight.global_scale is not None or weight.input_pre_scale is not None or weight.k % group or weight.k % 32:
        return f"{scheme.name} {weight.n}x{weight.k}: a global scale, a pre-scale or K not a multiple of the group"
    codes = weight.codes
    nibbles = torch.stack([codes & 0xF, codes >> 4], dim=-1).reshape(weight.n, -1)[:, : weight.k]
    base = 0
    if spec.format == "int4":  # offset binary: q + 8 is the nibble with its sign bit flipped
        nibbles, base = nibbles ^ 0x8, 8
    scales = weight.scale.reshape(weight.n, weight.k // group)
    zeros = torch.full_like(scales, float(base), dtype=torch.float32)
    if weight.zero_point is not None:
        zeros = zeros + weight.zero_point.reshape(scales.shape).float()
    return nibbles.contiguous(), scales, zeros, group


def gemlite_layer(weight: object, device: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """A GemLite 0.6 A16W4 layer (bf16) of ``weight`` on ``device``; raises if it cannot be built."""
    from gemlite.helper import A16Wn

    operands = gemlite_operands(weight)
    if isinstance(operands, str):
        raise ValueError(operands)
    codes, scales, zeros, group = operands
    builder = A16Wn(device=device, dtype=torch.bfloat16)
    layer: Callable[[torch.Tensor], torch.Tensor] = builder.from_weights(
        codes.to(device),
        scales.to(device, torch.bfloat16),
        zeros.to(device, torch.bfloat16),
        W_nbits=4,
        group_size=group,
    )
    return layer


def module_bytes(layer: object) -> int:
    """Bytes of the tensors a module holds (parameters, buffers and plain tensor attributes)."""
    tensors: dict[int, torch.Tensor] = {}
    if isinstance(layer, torch.nn.Module):
        tensors.update({id(t): t for t in [*layer.parameters(), *layer.buffers()]})
    tensors.update({id(t): t for t in vars(layer).values() if isinstance(t, torch.Tensor)})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def gemlite_unavailable(smoke: bool) -> str | None:
    """Why the GemLite row cannot run here, or None."""
    if smoke:
        return "gemlite: not run in a smoke run (its kernels need a CUDA GPU); its operands were checked"
    try:
        import gemlite  # noqa: F401
    except Exception as error:
        return (
            f"gemlite: not importable ({type(error).__name__}: {error}); build its wheel with "
            "scripts/build-gemlite-wheel.sh and install it with pip install --no-deps build/wheels/gemlite-*.whl"
        )
    return None


@dataclass
class Measured:
    rows: list[Row]
    errors: dict[tuple[str, str, int, int], float]
    memory: list[MemoryRow]
    notes: list[str]


def measure_shape(n: int, k: int, args: argparse.Namespace, facts: object, found: Measured) -> None:
    """Every scheme and kernel at one (N, K): bf16 ``F.linear`` once per M, then each kernel."""
    from qscheme.catalog import load_scheme
    from qscheme.triton.samples import model_scale_dtype, random_weight

    device, smoke = args.device, args.smoke
    dense = [torch.randn(n, k, device=device, dtype=torch.bfloat16)]
    if not smoke:  # distinct copies, so each call reads its weights from memory, not L2
        dense += [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(copies_for(n * k * 2) - 1)]
    inputs = {m: torch.randn(m, k, device=device, dtype=torch.bfloat16) for m in args.m_values}
    with torch.no_grad():
        torch_s = {
            m: timed([lambda w=w, x=x: torch.nn.functional.linear(x, w) for w in dense], smoke)[0]
            for m, x in inputs.items()
        }
    del dense
    x_check = torch.randn(CHECK_M, k, device=device, dtype=torch.bfloat16)
    for scheme_name in args.scheme:
        scheme = load_scheme(scheme_name)
        weight = random_weight(scheme, n, k, seed=1, scale_dtype=model_scale_dtype(scheme, torch.bfloat16))
        runnable = runnable_kernels(weight, facts, only=args.kernel or (), skip=args.skip or ())  # type: ignore[arg-type]
        found.notes += runnable.notes
        if not runnable.kernels:
            found.notes.append(f"{scheme.name} {n}x{k}: no kernel runs it here")
            continue
        expected = reference_output(weight, x_check)
        times: dict[str, dict[int, tuple[float, bool]]] = {}
        moved: dict[str, int] = {}
        for kernel in runnable.kernels:
            try:
                layer = build_layer(weight, kernel, device, facts)  # type: ignore[arg-type]
                moved[kernel] = state_bytes(layer)
                with torch.no_grad():
                    found.errors[(scheme.name, kernel, n, k)] = relative_error(layer(x_check), expected)
                layers = [layer]
                if not smoke:
                    copies = copies_for(moved[kernel])
                    layers += [build_layer(weight, kernel, device, facts) for _ in range(copies - 1)]  # type: ignore[arg-type]
                with torch.no_grad():
                    times[kernel] = {
                        m: timed([lambda copy=copy, x=x: copy(x) for copy in layers], smoke) for m, x in inputs.items()
                    }
            except Exception as error:  # one kernel failing must not lose the others' figures
                found.notes.append(f"{scheme.name} {n}x{k}: kernel {kernel} failed: {type(error).__name__}: {error}")
                continue
            if (n, k) == args.memory_shape:
                found.memory.append(memory_row(scheme, kernel, layer))
            if kernel == TRITON and not smoke and any(m <= GEMV_MAX_M for m in args.m_values):
                small = {m: x for m, x in inputs.items() if m <= GEMV_MAX_M}
                os.environ[GEMV_VARIABLE] = "1"  # the GEMV where the heuristic takes the GEMM's tiles
                try:
                    with torch.no_grad():
                        times[TRITON_GEMV] = {
                            m: timed([lambda copy=copy, x=x: copy(x) for copy in layers], smoke)
                            for m, x in small.items()
                        }
                    moved[TRITON_GEMV] = moved[TRITON]
                except Exception as error:
                    found.notes.append(f"{scheme.name} {n}x{k}: {TRITON_GEMV} failed: {type(error).__name__}: {error}")
                finally:
                    del os.environ[GEMV_VARIABLE]
            del layers, layer
        if args.gemlite:
            measure_gemlite(weight, n, k, args, inputs, x_check, expected, found, times, moved)
        for m in args.m_values:
            io_bytes = (m * k + m * n) * 2
            triton = times.get(TRITON, {}).get(m)
            for kernel, by_m in times.items():
                if m not in by_m:
                    continue
                seconds, eager = by_m[m]
                row = Row(
                    scheme.name,
                    kernel,
                    m,
                    n,
                    k,
                    seconds,
                    torch_s[m],
                    moved[kernel] + io_bytes,
                    n * k * 2 + io_bytes,
                    triton[0] if triton else None,
                    eager,
                )
                found.rows.append(row)
                print(row.line(args.peak), flush=True)


def measure_gemlite(
    weight: object,
    n: int,
    k: int,
    args: argparse.Namespace,
    inputs: dict[int, torch.Tensor],
    x_check: torch.Tensor,
    expected: torch.Tensor,
    found: Measured,
    times: dict[str, dict[int, tuple[float, bool]]],
    moved: dict[str, int],
) -> None:
    """The GemLite row of one (scheme, shape), or a note saying why there is none."""
    operands = gemlite_operands(weight)
    name = getattr(getattr(weight, "scheme", None), "name", "?")
    if isinstance(operands, str):
        return  # not an int4 group-scaled weight-only scheme: no GemLite row, nothing to say
    if args.smoke:  # the operands must dequantize to the canonical weight, bit for bit
        from qscheme.canonical import dequantize

        codes, scales, zeros, group = operands
        rebuilt = (codes.float().reshape(n, -1, group) - zeros[..., None]) * scales.float()[..., None]
        if not torch.equal(rebuilt.reshape(n, k), dequantize(weight)):  # type: ignore[arg-type]
            found.notes.append(f"{name} {n}x{k}: gemlite failed: its operands do not dequantize to the weight")
    reason = gemlite_unavailable(args.smoke)
    if reason is not None:
        if reason not in found.notes:
            found.notes.append(reason)
        return
    try:
        layer = gemlite_layer(weight, args.device)
        moved[GEMLITE] = module_bytes(layer)
        with torch.no_grad():
            found.errors[(name, GEMLITE, n, k)] = relative_error(layer(x_check), expected)
        layers = [layer] + [gemlite_layer(weight, args.device) for _ in range(copies_for(moved[GEMLITE]) - 1)]
        with torch.no_grad():
            times[GEMLITE] = {m: timed([lambda c=c, x=x: c(x) for c in layers], False) for m, x in inputs.items()}
    except Exception as error:  # GemLite failing must not lose the other kernels' figures
        found.notes.append(f"{name} {n}x{k}: kernel {GEMLITE} failed: {type(error).__name__}: {error}")


def run(args: argparse.Namespace) -> int:
    smoke = args.smoke
    args.device = "cpu" if smoke else "cuda"
    facts = device_facts(args.device, interpreter=smoke)
    name = "CPU (Triton interpreter)" if smoke else torch.cuda.get_device_name(0)
    args.peak = None if smoke else (args.peak_bandwidth or peak_bandwidth(name))
    lines = [f"Schemes {', '.join(args.scheme)}; bf16 activations, on {name}, torch {torch.__version__}."]
    if not smoke:
        lines.append(
            f"Peak memory bandwidth {f'{args.peak:.0f} GB/s' if args.peak else 'unknown (pass --peak-bandwidth)'}; "
            f"a 1 GiB device copy reaches {copy_bandwidth():.0f} GB/s."
        )
    else:
        lines.append("Smoke run: interpreted on the CPU, so the times say nothing about a GPU.")
    print("\n".join(lines) + "\n\n" + "\n".join(markdown_table(header(args.peak), [])), flush=True)
    found = Measured([], {}, [], [])
    for n, k in args.shapes:
        measure_shape(n, k, args, facts, found)
    order = {scheme: index for index, scheme in enumerate(args.scheme)}
    rows = sorted(found.rows, key=lambda r: (order.get(r.scheme, len(order)), args.shapes.index((r.n, r.k)), r.m))
    table = [*lines, "", *markdown_table(header(args.peak), [row.cells(args.peak) for row in rows]), ""]
    table.append(
        f"Largest error against the reference kernel at M={CHECK_M} (relative to the largest output; limit "
        f"{ERROR_LIMIT:.1e}):"
    )
    table += [
        "",
        *markdown_table(
            ("scheme", "kernel", "N x K", "error"),
            [
                [s, kernel, f"{n}x{k}", f"{error:.1e}"]
                for (s, kernel, n, k), error in sorted(
                    found.errors.items(),
                    key=lambda item: (order.get(item[0][0], len(order)), args.shapes.index(item[0][2:])),
                )
            ],
        ),
    ]
    if found.memory:
        n, k = args.memory_shape
        table += ["", f"Resident memory of each layer at {n}x{k} after its first forward:", ""]
        table += memory_table(found.memory)
    table += targets(rows, args.peak) if not smoke else []
    if found.notes:
        table += ["", "Notes:", *(f"- {note}" for note in found.notes)]
    text = "\n".join(table)
    print("\n" + text)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
    status = 0
    for (scheme, kernel, n, k), error in found.errors.items():
        if error > ERROR_LIMIT:
            print(
                f"gpu_gemm: kernel {kernel} disagrees with the reference kernel on {scheme} {n}x{k} ({error:.2e})",
                file=sys.stderr,
            )
            status = 1
    if any(note for note in found.notes if " failed: " in note):
        status = 1
    return status


def targets(rows: Sequence[Row], peak: float | None) -> list[str]:
    """The issue's NVFP4 W4A16 targets at 8192x8192, M <= 16, for every kernel but the reference."""
    from qscheme.catalog import load_scheme

    out: list[str] = []
    for row in rows:
        scheme = load_scheme(row.scheme)
        nvfp4_weight_only = scheme.weight_family == "nvfp4" and scheme.activation is None
        if not nvfp4_weight_only or (row.n, row.k) != (8192, 8192) or row.m > 16 or row.kernel == REFERENCE:
            continue
        if not out:
            out = ["", f"Targets ({row.scheme}, 8192x8192, M <= 16): >= {TARGET_SPEEDUP}x bf16, "]
            out[-1] += f">= {TARGET_ROOFLINE:.0%} of the roofline."
        speedup = row.torch_s / row.seconds
        fraction = row.moved_bytes / row.seconds / 1e9 / peak if peak else float("nan")
        ok = speedup >= TARGET_SPEEDUP and fraction >= TARGET_ROOFLINE
        out.append(
            f"- {row.kernel}, M={row.m}: {speedup:.2f}x, {fraction:.0%} of the roofline: {'met' if ok else 'NOT met'}"
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", action="append", help=f"scheme name (repeatable; default: {', '.join(SCHEMES)})")
    parser.add_argument("--kernel", action="append", help="only these kernels (repeatable; default: every runnable)")
    parser.add_argument("--skip", action="append", help="not these kernels (repeatable)")
    parser.add_argument("--shape", action="append", type=parse_shape, help="N x K, e.g. 8192x8192 (repeatable)")
    parser.add_argument("--m", type=int, action="append", dest="m_values", help="rows of the input (repeatable)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under the Triton interpreter")
    parser.add_argument("--peak-bandwidth", type=float, help="the GPU's peak memory bandwidth, GB/s")
    parser.add_argument("--markdown", help="also write the tables to this file")
    parser.add_argument("--no-gemlite", dest="gemlite", action="store_false", help="leave the GemLite row out")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print(
            "gpu_gemm: no CUDA GPU is visible (torch.cuda.is_available() is False), so there is nothing to "
            "measure. Run it on a machine with an NVIDIA GPU, or check the script itself on the CPU with "
            "--smoke (tiny shapes, Triton interpreter).",
            file=sys.stderr,
        )
        return 2
    args.scheme = args.scheme or list(SMOKE_SCHEMES if args.smoke else SCHEMES)
    args.shapes = args.shape or list(SMOKE_SHAPES if args.smoke else SHAPES)
    args.m_values = args.m_values or list(SMOKE_M_VALUES if args.smoke else M_VALUES)
    args.memory_shape = MEMORY_SHAPE if MEMORY_SHAPE in args.shapes else args.shapes[0]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
