"""Compile the Triton kernels for GPUs this machine does not have: cubins for compute capability
8.0, 9.0, 10.0 and 12.0 (and a ROCm gfx942 code object), with no GPU and no driver.

The launches compiled are the ones the host code builds (``qscheme.triton.linear`` and
``act_quant``) for small CPU tensors of each scheme; argument types and the divisibility
attributes come from Triton's own launch-time specialisation, so a kernel that compiles here
is the kernel that would be launched. A variant fails when it does not compile or needs more
shared memory than the target has.

Run it in a process without ``TRITON_INTERPRET`` (which turns the kernels into interpreted
functions at import) and with its own ``TRITON_CACHE_DIR``::

    python -m qscheme.triton.compile_check --targets sm80,sm90,sm100,sm120

``--subset ci`` compiles the set CI affords (see ``ci_plan``); the default compiles every
variant for every target. One JSON line per result is printed with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from qscheme.catalog import load_catalog, load_scheme
from qscheme.descriptor import Scheme
from qscheme.triton import configs
from qscheme.triton.act_quant import decoded_dtype, quantize_launch
from qscheme.triton.launch import Launch
from qscheme.triton.linear import Segment, gemm_launches, heuristic_for, prepare_weight
from qscheme.triton.samples import model_scale_dtype, random_weight
from qscheme.triton.sass import profile_cubin

TARGETS: dict[str, tuple[str, int | str, int]] = {
    "sm80": ("cuda", 80, 32),
    "sm90": ("cuda", 90, 32),
    "sm100": ("cuda", 100, 32),
    "sm120": ("cuda", 120, 32),
    "gfx942": ("hip", "gfx942", 64),
}
# Shared memory one program may use (opt-in maximum), bytes.
SHARED_MEMORY: dict[str, int] = {
    "sm80": 163 * 1024,
    "sm90": 227 * 1024,
    "sm100": 227 * 1024,
    "sm120": 99 * 1024,
    "gfx942": 64 * 1024,
}
_N, _K = 256, 512  # multiples of 16, like real layers, so pointers and sizes specialise alike


@dataclass(frozen=True)
class Variant:
    """One launch to compile, named."""

    name: str
    launch: Launch


@dataclass(frozen=True)
class CompileResult:
    variant: str
    target: str
    ok: bool
    seconds: float
    shared_bytes: int = 0
    registers: int | None = None
    spill_bytes: int | None = None
    error: str = ""
    # The main loop's static instruction counts per pass (qscheme.triton.sass); None on ROCm
    # or when the loop cannot be read.
    loop_instructions: int | None = None
    loop_classes: dict[str, int] | None = None


def target_device(target: str, name: str | None = None) -> configs.DeviceFacts:
    """What the tile heuristic is told about ``target``: an H100-sized part with the target's
    shared memory and compute capability."""
    backend, arch, _ = TARGETS[target]
    capability = (int(arch) // 10, int(arch) % 10) if backend == "cuda" else None
    return configs.DeviceFacts(name or f"compile-check {target}", 132, SHARED_MEMORY[target], capability)


def _input_dtypes(names: Iterable[str]) -> list[torch.dtype]:
    table = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    return [table[name] for name in names]


def scheme_variants(
    scheme: Scheme,
    target: str,
    input_dtypes: Sequence[torch.dtype] = (torch.bfloat16,),
    m_values: Sequence[int] = (16, 256),
    split_k: bool = True,
    fused_split_k: bool = False,
    k: int = _K,
    asm_decode: bool | None = None,
) -> list[Variant]:
    """The launches one scheme makes on ``target``: the pre-pass (if any) and the GEMM, with the
    tile the heuristic picks for a K=4096 layer, for each M and input dtype. Float scales are
    stored in the input's dtype where the scheme allows it, as checkpoints keep them.

    ``split_k=False`` keeps the GEMM in one pass (no split-K epilogue launch);
    ``fused_split_k`` reduces split-K partial sums in the GEMM launch (QSCHEME_TRITON_SPLIT_K=fused).
    ``k``: another K (a ragged one: the GEMM then zeroes padded weights where zero points need it).
    ``asm_decode``: force the inline-PTX 4-bit decoders on or off (default: the process's setting).
    """
    backend = TARGETS[target][0]
    device = target_device(target)
    variants: list[Variant] = []
    for dtype in input_dtypes:
        weight = random_weight(scheme, _N, k, scale_dtype=model_scale_dtype(scheme, dtype))
        prepared = prepare_weight(weight, "cpu")
        segment = Segment(0, _N, prepared.segments[0].static_scale)
        for m in m_values:
            x = torch.zeros((m, k), dtype=dtype)
            inputs, x_scale, decoded = x, None, False
            if prepared.spec.A_QUANTIZED:
                pre_pass, quantized = quantize_launch(
                    x,
                    prepared.spec,
                    static_scale=segment.static_scale,
                    divisor=prepared.divisor,
                    pre_scale=prepared.pre_scale,
                    decoded=decoded_dtype(prepared.spec, dtype),  # the GPU's dot dtype is x's
                )
                variants.append(Variant(f"{scheme.name} pre-pass {dtype_name(dtype)} M={m}", pre_pass))
                inputs, x_scale, decoded = quantized.codes, quantized.scale, quantized.decoded
            tile = heuristic_for(prepared, m, 4096, 4096, dtype, device)  # the tile of a 4096x4096 layer
            if not split_k:
                tile = replace(tile, split_k=1)
            out = torch.empty((m, _N), dtype=dtype)
            bias = torch.zeros((_N,), dtype=dtype)
            native_fp8 = backend == "cuda" and int(TARGETS[target][1]) >= 89
            launches = gemm_launches(
                prepared,
                segment,
                inputs,
                x_scale,
                bias,
                out,
                tile,
                dtype,
                backend,
                native_fp8,
                decoded,
                fused_split_k,
                asm_decode,
            )
            for launch in launches:
                kind = launch.label.split(" ")[0]
                fused = " fused" if fused_split_k and tile.split_k > 1 else ""
                if asm_decode is not None and "ASM_DECODE" in launch.constexprs:
                    fused += " asm" if launch.constexprs.get("ASM_DECODE") else " pure"
                shape = "" if k == _K else f" K={k}"
                name = f"{scheme.name} {kind}{fused} {dtype_name(dtype)} M={m}{shape} {tile.describe()}"
                variants.append(Variant(name, launch))
    return variants


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def _signature(launch: Launch) -> tuple[dict[str, str], dict[str, object], dict[tuple[int, ...], list[list[object]]]]:
    """Triton's own launch-time specialisation of the arguments: types, constants, attributes."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    signature: dict[str, str] = {}
    constants: dict[str, object] = dict(launch.constexprs)
    attributes: dict[tuple[int, ...], list[list[object]]] = {}
    for index, name in enumerate(launch.kernel.arg_names):
        if name in launch.constexprs:
            signature[name] = "constexpr"
            continue
        kind, attribute = native_specialize_impl(BaseBackend, launch.args[name], False, True, True)
        if kind == "constexpr":  # an integer equal to 1
            signature[name] = "constexpr"
            constants[name] = attribute
            continue
        signature[name] = kind
        parsed = BaseBackend.parse_attr(attribute)
        if parsed:
            attributes[(index,)] = parsed
    return signature, constants, attributes


def _resource_usage(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers, stack bytes) from cuobjdump, when the triton wheel ships it."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.is_file():
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        try:
            text = subprocess.run(
                [str(tool), "--dump-resource-usage", handle.name], capture_output=True, text=True, timeout=60
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return None, None
    fields = dict(part.split(":", 1) for part in text.split() if ":" in part and part.split(":", 1)[1].isdigit())
    registers = int(fields["REG"]) if "REG" in fields else None
    stack = int(fields["STACK"]) if "STACK" in fields else None
    return registers, stack


def compile_variant(variant: Variant, target: str) -> CompileResult:
    """Compile one variant for one target; never raises."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    start = time.perf_counter()
    try:
        signature, constants, attributes = _signature(variant.launch)
        source = ASTSource(variant.launch.kernel, signature, constants, attributes)
        options = {"num_warps": variant.launch.num_warps, "num_stages": variant.launch.num_stages}
        compiled = triton.compile(source, target=GPUTarget(*TARGETS[target]), options=options)
    except Exception as exc:
        message = str(exc).strip().splitlines()
        return CompileResult(
            variant.name, target, False, time.perf_counter() - start, error=f"{type(exc).__name__}: {message[-1:]}"
        )
    shared = int(compiled.metadata.shared)
    registers = spill = loop = None
    if "cubin" in compiled.asm:
        registers, spill = _resource_usage(compiled.asm["cubin"])
        loop = profile_cubin(compiled.asm["cubin"])
    limit = SHARED_MEMORY[target]
    error = "" if shared <= limit else f"needs {shared} bytes of shared memory; {target} has {limit}"
    return CompileResult(
        variant.name,
        target,
        not error,
        time.perf_counter() - start,
        shared,
        registers,
        spill,
        error,
        None if loop is None else loop.instructions,
        None if loop is None else loop.classes,
    )


# Jobs for worker processes (forked: the launches are not picklable).
_JOBS: list[tuple[Variant, str]] = []


def _run_job(index: int) -> CompileResult:
    variant, target = _JOBS[index]
    return compile_variant(variant, target)


def compile_all(jobs: Sequence[tuple[Variant, str]], workers: int) -> list[CompileResult]:
    """Compile (variant, target) pairs, in ``workers`` forked processes when more than one."""
    global _JOBS
    _JOBS = list(jobs)
    if workers <= 1 or len(jobs) <= 1:
        return [_run_job(i) for i in range(len(jobs))]
    context = multiprocessing.get_context("fork")
    with context.Pool(workers) as pool:
        return pool.map(_run_job, range(len(jobs)), chunksize=1)


def _key(variant: Variant) -> str:
    """What makes two launches the same compiled kernel (for one target)."""
    signature, constants, attributes = _signature(variant.launch)
    launch = variant.launch
    parts = (launch.kernel.__name__, signature, sorted(constants.items()), sorted(attributes.items()))
    return repr((*parts, launch.num_warps, launch.num_stages))


def _dedupe(variants: Iterable[Variant]) -> list[Variant]:
    """One variant per distinct compiled kernel (schemes often share a specialisation)."""
    seen: set[str] = set()
    unique = []
    for variant in variants:
        key = _key(variant)
        if key not in seen:
            seen.add(key)
            unique.append(variant)
    return unique


def full_plan(schemes: Sequence[Scheme], targets: Sequence[str]) -> list[tuple[Variant, str]]:
    """Every distinct variant of every scheme for every target: bf16 GEMV (M=1, weight-only
    schemes), decode and prefill tiles, and fp16 and fp32 too for the first scheme."""
    jobs: list[tuple[Variant, str]] = []
    for target in targets:
        variants: list[Variant] = []
        for index, scheme in enumerate(schemes):
            dtypes = (torch.bfloat16, torch.float16, torch.float32) if index == 0 else (torch.bfloat16,)
            variants.extend(scheme_variants(scheme, target, dtypes, (1, 16, 256)))
        jobs.extend((variant, target) for variant in _dedupe(variants))
    return jobs


CI_CORE = ("compressed-tensors/NVFP4A16", "compressed-tensors/NVFP4")


def ci_plan(schemes: Sequence[Scheme], targets: Sequence[str]) -> list[tuple[Variant, str]]:
    """What CI affords (about a minute on two cores).

    - every target: NVFP4 weight-only (bf16, decode tile, with its split-K epilogue, and with
      the split-K reduction fused into the GEMM) and NVFP4 W4A4 (pre-pass and GEMM), the
      kernels that matter most;
    - the first target also: NVFP4 weight-only with fp16 and fp32 inputs (the other dot paths)
      and the bf16 prefill tile (M=256);
    - every other distinct specialisation of ``schemes`` (bf16, decode tile, no split-K) on one
      target, the targets taken in turn: each specialisation compiles for some GPU;
    - int4 with tiled zero points at a ragged K (the decoded weights past K zeroed) on the second;
    - the inline-PTX decoder settings the defaults leave out (``ASM_DECODE_CASES``), one CUDA
      target each;
    - the CUDA-core GEMV (the heuristic's tile at M <= 4, ``qscheme.triton.gemv``): NVFP4
      weight-only at M=1 (split-K, two-pass and fused) on every target, and every other
      weight-only specialisation at M=4 (with fp16 inputs too for int4) on one target each, the
      targets taken in turn.
    """
    by_name = {scheme.name: scheme for scheme in schemes}
    core = [by_name[name] for name in CI_CORE if name in by_name]
    jobs: list[tuple[Variant, str]] = []
    for index, target in enumerate(targets):
        variants: list[Variant] = []
        for scheme in core:
            variants.extend(scheme_variants(scheme, target, (torch.bfloat16,), (16,)))
            if scheme.activation is None:  # the opt-in single-launch split-K reduction
                fused = scheme_variants(scheme, target, (torch.bfloat16,), (16,), fused_split_k=True)
                variants.extend(v for v in fused if " gemm fused " in v.name)
            if index == 0 and scheme.activation is None:
                variants.extend(scheme_variants(scheme, target, (torch.float16, torch.float32), (16,), split_k=False))
                variants.extend(scheme_variants(scheme, target, (torch.bfloat16,), (256,), split_k=False))
        jobs.extend((variant, target) for variant in _dedupe(variants))
    if "compressed-tensors/W4A16_ASYM" in by_name:  # ragged K with tiled zero points (W_MASK_K)
        target = targets[1 % len(targets)]
        ragged = scheme_variants(by_name["compressed-tensors/W4A16_ASYM"], target, (torch.bfloat16,), (16,), k=_K - 96)
        jobs.extend((variant, target) for variant in ragged if variant.launch.constexprs.get("W_MASK_K"))
    jobs.extend(_asm_decode_jobs(by_name, targets))
    gemv_schemes = [scheme for scheme in schemes if scheme.activation is None]
    for index, target in enumerate(targets):
        for scheme in gemv_schemes:
            if scheme.name in CI_CORE:
                gemv = scheme_variants(scheme, target, (torch.bfloat16,), (1,))
                gemv += scheme_variants(scheme, target, (torch.bfloat16,), (1,), fused_split_k=True)
            elif gemv_schemes.index(scheme) % len(targets) == index:
                dtypes = (
                    (torch.bfloat16, torch.float16) if scheme.name == "compressed-tensors/W4A16" else (torch.bfloat16,)
                )
                gemv = scheme_variants(scheme, target, dtypes, (4,), split_k=False)
            else:
                continue
            jobs.extend(
                (variant, target)
                for variant in _dedupe(gemv)
                if " gemv " in variant.name and (scheme.name in CI_CORE or not _compiled_elsewhere(variant, jobs))
            )
    compiled = {(_key(variant), target) for variant, target in jobs}
    # schemes of earlier-registered producers first (each producer's in catalog order), so that a new
    # producer's schemes, most of them sharing others' specialisations, move no earlier scheme
    others = sorted((scheme for scheme in schemes if scheme.name not in CI_CORE), key=_producer_rank)
    for index, scheme in enumerate(others):
        target = targets[index % len(targets)]
        for variant in scheme_variants(scheme, target, (torch.bfloat16,), (16,), split_k=False):
            if (_key(variant), target) not in compiled and not _compiled_elsewhere(variant, jobs):
                compiled.add((_key(variant), target))
                jobs.append((variant, target))
    return jobs


def _producer_rank(scheme: Scheme) -> int:
    """The position of the scheme's producer in ``qscheme.producers.PRODUCERS`` (others last)."""
    from qscheme.producers import PRODUCERS

    names = [producer.name for producer in PRODUCERS]
    return names.index(scheme.producer) if scheme.producer in names else len(names)


# The inline-PTX decoders' settings the defaults do not compile (``linear.asm_decode_enabled``):
# (scheme, forced setting); one target each, taken in turn.
ASM_DECODE_CASES = (
    ("compressed-tensors/W4A16", False),  # int4's pure decoder on CUDA (QSCHEME_TRITON_ASM_DECODE=0)
    ("compressed-tensors/NVFP4A16", True),  # e2m1, unscaled (scale folded), opt-in
    ("compressed-tensors/MXFP4A16", True),  # e2m1 times 2**126 in the asm, opt-in
)


def _asm_decode_jobs(by_name: dict[str, Scheme], targets: Sequence[str]) -> list[tuple[Variant, str]]:
    """The GEMM of each ``ASM_DECODE_CASES`` entry (bf16, decode tile, one pass) on one CUDA target."""
    cuda = [target for target in targets if TARGETS[target][0] == "cuda"]
    jobs: list[tuple[Variant, str]] = []
    for index, (name, setting) in enumerate(ASM_DECODE_CASES):
        if name not in by_name or not cuda:
            continue
        target = cuda[index % len(cuda)]
        variants = scheme_variants(by_name[name], target, (torch.bfloat16,), (16,), split_k=False, asm_decode=setting)
        jobs.extend((variant, target) for variant in variants if "ASM_DECODE" in variant.launch.constexprs)
    return jobs


def _compiled_elsewhere(variant: Variant, jobs: Sequence[tuple[Variant, str]]) -> bool:
    """Whether the same specialisation (up to target-dependent flags) is already planned."""
    flags = ("USE_PTX", "NATIVE_FP8", "ASM_DECODE")
    constants = {k: v for k, v in variant.launch.constexprs.items() if k not in flags}
    return any(
        other.launch.kernel is variant.launch.kernel
        and {k: v for k, v in other.launch.constexprs.items() if k not in flags} == constants
        and _signature(other.launch)[0] == _signature(variant.launch)[0]
        for other, _ in jobs
    )


def _schemes(names: Sequence[str]) -> list[Scheme]:
    if not names:  # the Triton kernel's schemes: packed blocks are not its family
        return [scheme for scheme in load_catalog(include_plugins=False) if scheme.weight.blocks is None]
    return [load_scheme(name) for name in names]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m qscheme.triton.compile_check", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--targets", default="sm80,sm90,sm100,sm120", help=f"comma-separated, of {', '.join(TARGETS)}")
    parser.add_argument(
        "--scheme", action="append", default=[], help="scheme name or descriptor file (default: built-ins)"
    )
    parser.add_argument("--extra-scheme", action="append", default=[], help="descriptor added to the schemes")
    parser.add_argument("--subset", choices=("all", "ci"), default="all")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", action="store_true", help="one JSON object per result")
    args = parser.parse_args(argv)

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_check: unset TRITON_INTERPRET (it makes the kernels interpreted functions)", file=sys.stderr)
        return 2
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        print(f"compile_check: unknown target {unknown[0]!r}; choose from {', '.join(TARGETS)}", file=sys.stderr)
        return 2
    schemes = _schemes(args.scheme) + [load_scheme(path) for path in args.extra_scheme]
    plan = ci_plan if args.subset == "ci" else full_plan
    started = time.perf_counter()
    results = compile_all(plan(schemes, targets), args.workers)
    for result in results:
        if args.json:
            print(json.dumps(asdict(result)))
        else:
            status = "ok  " if result.ok else "FAIL"
            usage = f"shared {result.shared_bytes:>6}"
            if result.registers is not None:
                usage += f" regs {result.registers:>3} spill {result.spill_bytes}"
            if result.loop_instructions is not None:
                usage += f" loop {result.loop_instructions:>4}"
            print(f"{status} {result.target:<6} {result.seconds:5.2f}s {usage}  {result.variant}  {result.error}")
    failed = [r for r in results if not r.ok]
    summary = f"{len(results) - len(failed)}/{len(results)} compiled in {time.perf_counter() - started:.1f}s"
    print(summary if not args.json else json.dumps({"summary": summary}), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
