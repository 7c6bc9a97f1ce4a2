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

from dataclasses import replace

from qscheme_plugins.cpu_boundaries import BF16_DOT_BOUNDARY, E4M3_BF16_DOT_BOUNDARY, FLOAT32_BOUNDARY

from qscheme.kernels.declaration import (
    ANY_WEIGHT_ONLY,
    BLOCKS_WEIGHT_ONLY,
    CODEBOOK_WEIGHT_ONLY,
    DEPLOYED_ACTIVATION_PAIRS,
    NVFP4_ACTIVATION_PAIR,
    ActivationDtypes,
    BatchRange,
    DeviceSupport,
    KernelDeclaration,
    PreparedState,
)
from qscheme.plugins import hookimpl

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
    # from the boundaries where they hold (qscheme_plugins.cpu_boundaries), else M >= 16
    batch_ranges=(
        E4M3_BF16_DOT_BOUNDARY.gemm_range(),
        BF16_DOT_BOUNDARY.gemm_range(),
        FLOAT32_BOUNDARY.gemm_range(),
        CPU_BATCHES,
    ),
    prepared_state=PreparedState("canonical"),
)


@hookimpl
def qscheme_kernels() -> list[KernelDeclaration]:
    return [DEQUANT_GEMM]
