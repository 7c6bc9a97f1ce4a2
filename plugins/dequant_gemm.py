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
    ActivationDtypes,
    BatchRange,
    DeviceSupport,
    KernelDeclaration,
    PreparedState,
)
from qscheme.plugins import hookimpl

# Where the tile GEMM starts to beat the other kernels on a CPU, from benchmarks/cpu_plan.py
# (4096x4096, bf16 inputs, 1 and 2 threads; the figures are in that script's docstring).
CPU_BATCHES = BatchRange(
    "cpu",
    m_min=16,
    source="benchmarks/cpu_plan.py, 4096x4096 bf16 on 2 AVX-512/AMX cores: faster than the reference kernel from "
    "M = 2 and than bf16 F.linear's weight read from M = 16",
)

DEQUANT_GEMM = KernelDeclaration(
    name="dequant_gemm",
    provider="qscheme",
    priority=10,
    description="dequantize row tiles exactly into the activation dtype, then torch's GEMM (large batches)",
    supports=(replace(ANY_WEIGHT_ONLY, input_permutation=True), BLOCKS_WEIGHT_ONLY),
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
