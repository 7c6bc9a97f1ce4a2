"""The Triton fallback kernel's declaration (its code is ``qscheme_plugins.triton_kernel``).

Weight-only for every weight family (e2m1 with e4m3/e8m0/float scales, int4/uint4 with zero
points, int8, fp8, and 4-bit codebooks such as NF4, decoded through their table in float32), plus
the activation-quantized pairs deployed kernels run: NVFP4 x NVFP4
(also e2m1 weights with float scales, any group size: the weight scales are decoded in the K
loop independently of the input's groups of 16), FP8 x FP8 (static per tensor, dynamic per
token, dynamic per group of 128), int8 x int8 per token (int8/uint8 weights, zero points
included) and MXFP4 x MXFP4; one global scale per fused partition; 16-bit and fp32 activations.
Activations are claimed in the element and scale formats both the pre-pass
(``qscheme.triton.spec``) and the reference emulation run: e2m1 with e4m3 or e8m0 scales, e4m3
and int8 with float32 scales (any float for a static scale); not e5m2 or uint8 inputs, nor
16-bit dynamic scales (the pre-pass would compute them in float32, which the emulation refuses).
NVFP4 weights with FP8 activations are deliberately not claimed. Runs on CUDA compute capability
8.0 or newer, on ROCm, and on a CPU only under the Triton interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

from qscheme.kernels.declaration import (
    ANY_WEIGHT_ONLY,
    CODEBOOK_WEIGHT_ONLY,
    DEPLOYED_ACTIVATION_PAIRS,
    NVFP4_ACTIVATION_PAIR,
    ActivationDtypes,
    CapabilityRange,
    DeviceSupport,
    KernelDeclaration,
)
from qscheme.plugins import hookimpl

TRITON = KernelDeclaration(
    name="triton",
    provider="qscheme",
    priority=50,
    description="Triton dequantize-in-register GEMM, portable across CUDA, ROCm and the Triton interpreter",
    supports=(
        ANY_WEIGHT_ONLY,
        CODEBOOK_WEIGHT_ONLY,
        NVFP4_ACTIVATION_PAIR,
        *DEPLOYED_ACTIVATION_PAIRS,
    ),
    devices=(
        DeviceSupport("cuda", capabilities=(CapabilityRange((8, 0)),)),
        DeviceSupport("rocm"),
        DeviceSupport("cpu", environment=(("TRITON_INTERPRET", "1"),)),
    ),
    implementation="qscheme_plugins.triton_kernel:TritonKernel",
    requires_modules=("triton",),
    checks=(ActivationDtypes(("bfloat16", "float16", "float32")),),
)


@hookimpl
def qscheme_kernels() -> list[KernelDeclaration]:
    return [TRITON]
