"""The ``dequant_gemm`` kernel's declaration: decode tiles into bfloat16 and multiply them, for large M.

It takes every scheme the reference kernel takes (scale-and-codes layouts with zero points,
per-partition scales, AWQ pre-scales and permuted input channels, packed blocks, codebooks, and
the quantized-activation pairs, emulated as the reference kernel emulates them), on the CPU, with
bfloat16 and float32 inputs (float16 is left to the reference kernel: a weight beyond float16's
range would overflow in a float16 tile). Its state is the canonical tensors themselves, so it
joins any kernel in a plan without a second copy of the weight. It is meant for large batches
only (``batch_ranges``): below the boundary a GEMV kernel, or the reference kernel, runs the
layer. The code is in ``qscheme_plugins.dequant_gemm_kernel`` and ``qscheme.tile_gemm``.

Priority 55: above the Triton kernel (50), which runs on a CPU only under the Triton interpreter
(a test path), so that the interpreter never takes a batch size this native kernel is declared
for; its range (M >= 16) does not overlap the GEMV kernels' (M <= 15), so nothing else changes.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from qscheme.kernels.declaration import (
    ANY_WEIGHT_ONLY,
    BLOCKS_WEIGHT_ONLY,
    CODEBOOK_WEIGHT_ONLY,
    DEPLOYED_ACTIVATION_PAIRS,
    NVFP4_ACTIVATION_PAIR,
    PASSED,
    ActivationDtypes,
    BatchRange,
    CheckResult,
    DeviceSupport,
    KernelDeclaration,
    PreparedState,
    WeightFormats,
)
from qscheme.plugins import hookimpl

if TYPE_CHECKING:
    from qscheme.kernels.problem import Problem


@dataclass(frozen=True)
class ExtensionLoops:
    """One of qscheme's CPU extensions runs one of these loops here: ``qscheme.<module>.isa()``
    (``tile_gemm``: "amx", "avx512" for VDPBF16PS dot products on CPUs without AMX, "scalar";
    ``cpu_gemv``: "avx512", "avx2", "scalar")."""

    module: str
    isas: tuple[str, ...]

    def check(self, problem: Problem) -> CheckResult:
        loops = importlib.import_module(f"qscheme.{self.module}").isa()  # torch: imported only when a plan asks
        if loops in self.isas:
            return PASSED
        return CheckResult(
            False,
            f"qscheme._{self.module} runs its {loops} loops here, not {' or '.join(self.isas)}",
            "the kernels' other declared batch ranges hold here",
        )

    def describe(self) -> str:
        return f"qscheme._{self.module}'s {' or '.join(self.isas)} loops"


# float32 inputs of the canonical formats on cpu_gemv's AVX-512 loops: its GEMV beats the float32 tiles
# (decoded rows, torch's float32 GEMM) up to M = 32-48; the packed blocks' float32 GEMV loses from 16-32
FLOAT32_GEMV = (
    ActivationDtypes(("float32",)),
    ExtensionLoops("cpu_gemv", ("avx512",)),
    WeightFormats(("blocks",), exclude=True),
)
FLOAT32_GEMV_SOURCE = (
    "QuantLinear with the kernel forced, 4096x4096, float32 inputs, 2 threads, 2-core Zen 4 EPYC, time of "
    "dequant_gemm over cpu_gemv's: M = 16: NVFP4A16 1.09x, FP8 1.79x, W4A16 1.91x, FP8_DYNAMIC 1.80x; M = 32: "
    "1.07x, 1.21x, 1.29x, 1.20x; M = 48: 0.90x, 1.03x, 1.13x, 1.05x; M = 64: 0.81x, 0.90x, 0.95x, 0.90x "
    "(GGUF blocks: cpu_gemv_blocks loses from M = 16-32, Q6_K 1.83x slower at 16, so they keep M = 16)"
)

# Where the bfloat16 tile GEMM runs as VDPBF16PS dot products (AVX512-BF16, no AMX) it beats the GEMV
# kernels from M = 5: the conditions of the ranges measured there (cpu_gemv, tinygemm_cpu and
# dequant_gemm declare theirs under them; other CPUs keep the boundary at 16).
BF16_DOT_TILES = (ActivationDtypes(("bfloat16",)), ExtensionLoops("tile_gemm", ("avx512",)))
BF16_DOT_SOURCE = (
    "benchmarks/cpu_gemm.py, 4096x4096, bf16, 2 threads, 2-core Zen 4 EPYC (AVX512-BF16, no AMX), same-run "
    "ratios to bf16 F.linear, dequant_gemm / cpu_gemv: M = 5: NVFP4A16 1.35-1.55x / 0.82-0.95x, W4A16 1.68x / "
    "1.01x, W4A16_ASYM 1.68x / 0.92x, MXFP4A16 1.42x / 0.91x, FP8 0.96x / 0.98x, W8A16_G32 0.94x / 0.84x; M = 8: "
    "1.45-1.71x / 0.48-0.87x (4-bit), 0.97-1.13x / 0.43-0.73x (8-bit, FP8_DYNAMIC included); GPTQ "
    "W4A16_ASYM_G32 M = 5-12: 1.35-1.52x, tinygemm_cpu 0.89-1.11x; at M = 4 the GEMVs win (NVFP4A16 2.20x / "
    "1.60x dequant_gemm, FP8 1.28x / 1.06x, tinygemm_cpu 1.77x / 1.63x)"
)

# Where the tile GEMM starts to beat the GEMV kernels on a CPU: benchmarks/cpu_plan.py, 4096x4096,
# bf16 inputs, 1 and 2 threads, two AVX-512/AMX cores shared with other jobs. Before the fused AMX
# tiles: NVFP4A16 against cpu_gemv, crossover between M = 12 and 24 (M = 16 in two of four runs).
# With them (qscheme.tile_gemm) the tiles are 1.1-1.6x bf16 F.linear at M = 16 (1 thread, load 7-12)
# where cpu_gemv is 0.5-1x; tinygemm_cpu (int4) is 2-10x slower than the tiles at M = 16-256. 16 stays
# the boundary declared (see the source for the figures of this tree).
CPU_BATCHES = BatchRange(
    "cpu",
    m_min=16,
    source="benchmarks/cpu_plan.py, NVFP4A16 / W4A16 4096x4096 bf16, 1 and 2 threads: the AMX tiles beat "
    "cpu_gemv and tinygemm_cpu from M = 16 on (cpu_gemv's GEMV wins below)",
)

CPU_BF16_DOT_BATCHES = BatchRange("cpu", m_min=5, source=BF16_DOT_SOURCE, when=BF16_DOT_TILES)
CPU_FLOAT32_BATCHES = BatchRange("cpu", m_min=48, source=FLOAT32_GEMV_SOURCE, when=FLOAT32_GEMV)

DEQUANT_GEMM = KernelDeclaration(
    name="dequant_gemm",
    provider="qscheme",
    priority=55,
    description="decode weight tiles exactly into bf16 (AVX-512), multiply on AMX or AVX-512 BF16 (or torch's GEMM)",
    supports=(
        replace(ANY_WEIGHT_ONLY, input_permutation=True),
        BLOCKS_WEIGHT_ONLY,
        CODEBOOK_WEIGHT_ONLY,
        NVFP4_ACTIVATION_PAIR,
        *DEPLOYED_ACTIVATION_PAIRS,
    ),
    devices=(DeviceSupport("cpu"),),
    implementation="qscheme_plugins.dequant_gemm_kernel:DequantGemmKernel",
    requires_modules=("torch",),
    checks=(ActivationDtypes(("bfloat16", "float32")),),
    notes=(
        "bfloat16 inputs: each weight is the reference's float32 weight rounded once to bfloat16 (at most "
        "2**-9 * |w|); products are summed in float32 and the output rounded once to bfloat16, with the bias "
        "added in float32 before; an AWQ pre-scale multiplies the input in float32, rounded once to bfloat16",
        "quantized activations are emulated exactly as the reference kernel emulates them, in float32; with "
        "bfloat16 inputs that input is then rounded once to bfloat16 (at most 2**-9 * |x| per element)",
        "on AMX tiles, or VDPBF16PS dot products on AVX-512 BF16 CPUs without AMX (qscheme._tile_gemm; "
        "QSCHEME_TILE_GEMM_ISA=avx512 or scalar narrows it), bfloat16 subnormal weights and inputs (below "
        "2**-126) count as zero, as in oneDNN's bfloat16 GEMM; elsewhere torch's GEMM (oneDNN) multiplies the "
        "bfloat16 tiles",
        "float32 inputs: the reference kernel's float32 weight and products, summed in another order",
        "memory: keeps the canonical tensors (no copy); while it runs, each thread holds a panel of at most "
        "32 x 4128 bfloat16 weights (258 KiB) with its float32 accumulators and scales, and the input packed once "
        "(AMX) or padded to whole 32-column chunks (AVX-512 BF16), or one tile of float32 rows (8 MiB at most) "
        "and its bfloat16 copy; all freed when it returns",
    ),
    batch_ranges=(CPU_BF16_DOT_BATCHES, CPU_FLOAT32_BATCHES, CPU_BATCHES),
    prepared_state=PreparedState("canonical"),
)


@hookimpl
def qscheme_kernels() -> list[KernelDeclaration]:
    return [DEQUANT_GEMM]
