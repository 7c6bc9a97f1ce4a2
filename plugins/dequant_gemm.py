"""The ``dequant_gemm`` kernel's declaration: dequantize row tiles, then torch's GEMM, for large M.

It takes every weight-only scheme the reference kernel takes (scale-and-codes layouts with zero
points, per-partition scales, AWQ pre-scales and permuted input channels, and packed blocks), on
the CPU, with bfloat16 and float32 inputs (float16 is left to the reference kernel: a weight
beyond float16's range would overflow in a float16 tile). Its state is the canonical tensors
themselves, so it joins any kernel in a plan without a second copy of the weight. It is meant
for large batches only (``batch_ranges``): below the boundary a GEMV kernel, or the reference
kernel, runs the layer. The code is in ``qscheme_plugins.dequant_gemm_kernel``.
"""

from __future__ import annotations

from dataclasses import replace

from qscheme.kernels.declaration import (
    ANY_WEIGHT_ONLY,
    BLOCKS_WEIGHT_ONLY,
    CODEBOOK_WEIGHT_ONLY,
    ActivationDtypes,
    BatchRange,
    DeviceSupport,
    KernelDeclaration,
    PreparedState,
)
from qscheme.plugins import hookimpl

# Where the tile GEMM starts to beat the GEMV kernels on a CPU: benchmarks/cpu_plan.py and the same
# comparison by hand, compressed-tensors/NVFP4A16 4096x4096, bf16 inputs, against cpu_gemv (its row
# decoder feeding the tiles), on two AVX-512/AMX cores shared with other jobs (load average 4-7, so
# single figures move 2x; medians of 5-9 calls). Crossover: 2 threads M = 16 (gemv 29.9 / tiles 28.9 ms;
# M = 8: 15.7 / 29.5; M = 32: 44.6 / 17.3) and M = 12 in a second run; 1 thread M = 16 (30.2 / 30.2;
# M = 12: 20.7 / 31.3; M = 32: 59.7 / 32.6) and M = 24 in a second run. The reference kernel is 3-9x
# slower than the tiles at every M >= 8. 16 is the boundary declared.
CPU_BATCHES = BatchRange(
    "cpu",
    m_min=16,
    source="benchmarks/cpu_plan.py, NVFP4A16 4096x4096 bf16, 1 and 2 threads: the tiles overtake the cpu_gemv "
    "GEMV between M = 12 and 24 (M = 16 in two of four runs on a shared machine)",
)

DEQUANT_GEMM = KernelDeclaration(
    name="dequant_gemm",
    provider="qscheme",
    priority=10,
    description="dequantize row tiles exactly into the activation dtype, then torch's GEMM (large batches)",
    supports=(replace(ANY_WEIGHT_ONLY, input_permutation=True), BLOCKS_WEIGHT_ONLY, CODEBOOK_WEIGHT_ONLY),
    devices=(DeviceSupport("cpu"),),
    implementation="qscheme_plugins.dequant_gemm_kernel:DequantGemmKernel",
    requires_modules=("torch",),
    checks=(ActivationDtypes(("bfloat16", "float32")),),
    notes=(
        "bfloat16 inputs: each weight is the reference's float32 weight rounded once to bfloat16 (at most "
        "2**-9 * |w|); products are summed in float32 and the output rounded once to bfloat16, with the bias "
        "added in the GEMM; an AWQ pre-scale multiplies the input in float32, rounded once to bfloat16",
        "float32 inputs: the reference kernel's float32 weight and products, summed in another order",
        "memory: keeps the canonical tensors (no copy); a call holds one tile of float32 rows (8 MiB at most) "
        "and its bfloat16 copy, freed when it returns",
    ),
    batch_ranges=(CPU_BATCHES,),
    prepared_state=PreparedState("canonical"),
)


@hookimpl
def qscheme_kernels() -> list[KernelDeclaration]:
    return [DEQUANT_GEMM]
