"""Native FP4 GEMMs (W4A4) through ``torch.nn.functional.scaled_mm``: NVFP4 x NVFP4 and MXFP4 x MXFP4.

Two kernels, one code (``qscheme_plugins.native_fp4_kernel``, whose docstring gives the operand
layout). Each quantizes the activation itself with exactly the codes and block scales of the
reference emulation (``qscheme.emulation``; the Triton pre-pass on a GPU), packs both operands
as ``float4_e2m1fn_x2`` and swizzles their block scales into the 128x4 tile layout
(``SwizzleType.SWIZZLE_32_4_4``). K is padded with zero codes to whole tiles of 4 scale groups,
weight rows to 128, the activation's scales to 128 rows (M = 1 runs); the output is sliced
back, so no shape is refused (the schemes' own layout needs K % 16 or K % 32).

- ``native_fp4``: NVFP4 (e2m1, e4m3 scales per 16) weights and activations, recipes
  ``[BlockWise1x16, TensorWise]``: torch multiplies the block-scaled product by the product of
  the two float32 global dequant multipliers. CUDA compute capability 10.0-10.3 (B200, GB200,
  B300) and 12.0-12.1 (RTX 50, GB10), two families, never a minimum. The GEMM writes the input's
  dtype: bf16 and fp16 activations. Fused partitions with different weight or input global
  scales run as one GEMM per run of partitions sharing them (the input quantized once per
  distinct input scale): exact, never a shared maximum. AWQ pre-scales (modelopt/NVFP4_AWQ) are
  applied before the activation is quantized.
- ``native_mxfp4``: MXFP4 (e2m1, e8m0 scales per 32), recipe ``BlockWise1x32``. torch 2.13 runs
  it on compute capability 10.x only ("MXFP4 scaling only supported in CUDA for B200/B300"; an
  RTX 50 is refused) and only in CUDA builds with MSLK, whose f4f4bf16 writes bf16 and ignores
  the bias: the implementation refuses to load under a torch without MSLK, the GEMM always
  writes bf16, so only bf16 activations are declared, and the bias is added outside the GEMM.
  (torch 2.13's meta check of this recipe counts scale columns over the packed K, half the
  CUDA kernel's count; the operands follow the CUDA kernel.)

Both add the bias in float32 to the GEMM's rounded output and round once more. Weight-only FP4
schemes (NVFP4A16, MXFP4A16, W4A16_NVFP4) and NVFP4 weights with FP8 inputs are not claimed.
"""

from __future__ import annotations

from qscheme.kernels.declaration import (
    NVFP4_ACTIVATIONS,
    ActivationDtypes,
    ActivationSupport,
    CapabilityRange,
    DeviceSupport,
    KernelDeclaration,
    Supports,
)
from qscheme.plugins import hookimpl

DATACENTER_BLACKWELL = CapabilityRange((10, 0), (10, 3))
BLACKWELL = (DATACENTER_BLACKWELL, CapabilityRange((12, 0), (12, 1)))

MXFP4_ACTIVATIONS = ActivationSupport("mxfp4", "group", 32, dynamic=True, formats=("e2m1",), scale_formats=("e8m0",))

CPU_TESTED = (
    "activation codes and block scales are bit-identical to the reference emulation (qscheme.emulation); "
    "on a CPU the operands, multiplied by an exact emulation of the block-scaled GEMM, match the reference "
    "kernel to float32 rounding (max error <= 1e-5 of the largest output, tests/test_native_fp4.py)"
)
OUTPUT_ROUNDING = (
    "the GEMM rounds its float32 accumulation to the output dtype, then the bias is added in float32 and "
    "the sum rounded again: each output within 1.5 x eps(dtype) x (|x W^T| + |bias|) of the reference's "
    "(which rounds once), plus the float32 term above"
)
NOT_RUN_YET = (
    "not yet run on an sm100 / sm120 GPU by qscheme's tests (none was available); the gpu-marked tests in "
    "tests/test_native_fp4.py compare the real GEMM with the reference and the CPU emulation where one is"
)

NATIVE_FP4 = KernelDeclaration(
    name="native_fp4",
    provider="torch",
    priority=100,
    description="NVFP4 x NVFP4 tensor-core GEMM via torch.nn.functional.scaled_mm (float4_e2m1fn_x2 operands)",
    supports=(
        Supports(
            weights=("nvfp4",),
            activations=(NVFP4_ACTIVATIONS,),
            granularities=("group",),
            group_sizes=(16,),
            scale_formats=("e4m3",),
            per_partition_scales=True,
            input_pre_scale=True,
        ),
    ),
    devices=(DeviceSupport("cuda", capabilities=BLACKWELL),),
    implementation="qscheme_plugins.native_fp4_kernel:NativeFp4Kernel",
    torch_features=(
        "float4_e2m1fn_x2",
        "float8_e4m3fn",
        "nn.functional.scaled_mm",
        "nn.functional.ScalingType.BlockWise1x16",
        "nn.functional.ScalingType.TensorWise",
        "nn.functional.SwizzleType.SWIZZLE_32_4_4",
    ),
    checks=(ActivationDtypes(("bfloat16", "float16")),),
    notes=(
        CPU_TESTED,
        OUTPUT_ROUNDING,
        "fused partitions with different global scales: one GEMM per run of partitions sharing them (exact)",
        NOT_RUN_YET,
    ),
)

NATIVE_MXFP4 = KernelDeclaration(
    name="native_mxfp4",
    provider="torch",
    priority=100,
    description="MXFP4 x MXFP4 tensor-core GEMM via torch.nn.functional.scaled_mm (B200/B300, torch with MSLK)",
    supports=(
        Supports(
            weights=("mxfp4",),
            activations=(MXFP4_ACTIVATIONS,),
            granularities=("group",),
            group_sizes=(32,),
            scale_formats=("e8m0",),
            # MXFP4 has no global scale: every scale is a per-row block scale, so fused
            # partitions always run exactly.
            per_partition_scales=True,
            input_pre_scale=True,
        ),
    ),
    devices=(DeviceSupport("cuda", capabilities=(DATACENTER_BLACKWELL,)),),
    implementation="qscheme_plugins.native_fp4_kernel:NativeMxfp4Kernel",
    torch_features=(
        "float4_e2m1fn_x2",
        "float8_e8m0fnu",
        "nn.functional.scaled_mm",
        "nn.functional.ScalingType.BlockWise1x32",
        "nn.functional.SwizzleType.SWIZZLE_32_4_4",
    ),
    checks=(ActivationDtypes(("bfloat16",)),),
    notes=(
        CPU_TESTED,
        OUTPUT_ROUNDING + " (the GEMM writes bf16)",
        "needs a CUDA build of torch with MSLK (USE_MSLK); under one without it the implementation refuses "
        "to load and layers resolve to the next kernel",
        NOT_RUN_YET,
    ),
)


@hookimpl
def qscheme_kernels() -> list[KernelDeclaration]:
    return [NATIVE_FP4, NATIVE_MXFP4]
