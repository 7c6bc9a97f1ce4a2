"""Native FP4 GEMM (W4A4: NVFP4 x NVFP4, MXFP4 x MXFP4): declaration only.

torch._scaled_mm / cuBLASLt / CUTLASS with torch.float4_e2m1fn_x2 operands run on two
hardware families, compute capability 10.0-10.3 (B200/GB200/B300) and 12.0-12.1 (RTX 50,
GB10): declared as two ranges, never as a minimum. Block scales are swizzled into the 128x4
layout and operands padded to multiples of 32 at prepare time; the GEMM's alpha is one scalar,
so fused partitions must share their global scales. No qscheme implementation exists yet.
"""

from __future__ import annotations

from qscheme.kernels.declaration import (
    ActivationDtypes,
    ActivationSupport,
    CapabilityRange,
    DeviceSupport,
    KernelDeclaration,
    ShapeAlignment,
    Supports,
)
from qscheme.plugins import hookimpl

BLACKWELL = (CapabilityRange((10, 0), (10, 3)), CapabilityRange((12, 0), (12, 1)))

NATIVE_FP4 = KernelDeclaration(
    name="native_fp4",
    provider="torch",
    priority=100,
    description="native FP4 tensor-core GEMM via torch._scaled_mm with float4_e2m1fn_x2 operands",
    supports=(
        Supports(
            weights=("nvfp4",),
            activations=(ActivationSupport("nvfp4", "group", 16, dynamic=True),),
            granularities=("group",),
            group_sizes=(16,),
            scale_formats=("e4m3",),
        ),
        Supports(
            weights=("mxfp4",),
            activations=(ActivationSupport("mxfp4", "group", 32, dynamic=True),),
            granularities=("group",),
            group_sizes=(32,),
            scale_formats=("e8m0",),
        ),
    ),
    devices=(DeviceSupport("cuda", capabilities=BLACKWELL),),
    implementation=None,
    torch_features=("float4_e2m1fn_x2", "_scaled_mm"),
    checks=(ShapeAlignment(((16, 32),)), ActivationDtypes(("bfloat16", "float16"))),
)


@hookimpl
def qscheme_kernels() -> list[KernelDeclaration]:
    return [NATIVE_FP4]
