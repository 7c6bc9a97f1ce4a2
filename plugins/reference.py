"""The torch reference kernel's declaration: every scheme on any device, at the lowest priority.

Weight-only schemes run as dequantize-then-matmul; schemes that quantize activations run with
an exact quantize-dequantize emulation of the pairs deployed kernels run. The code is in
``qscheme_plugins.reference_kernel`` and is imported only when a layer uses it.
"""

from __future__ import annotations

from qscheme.kernels.declaration import (
    ANY_DEVICE,
    ANY_WEIGHT_ONLY,
    DEPLOYED_ACTIVATION_PAIRS,
    ActivationDtypes,
    ActivationSupport,
    DeviceSupport,
    KernelDeclaration,
    Supports,
)
from qscheme.plugins import hookimpl

REFERENCE = KernelDeclaration(
    name="reference",
    provider="qscheme",
    priority=0,
    description="torch dequantize-then-matmul in float32, with exact activation quantization emulation",
    # Every entry takes per-partition scales (canonical dequantization handles them) and AWQ
    # pre-scales (applied before the activation is quantized).
    supports=(
        ANY_WEIGHT_ONLY,
        Supports(
            weights=("nvfp4",),
            activations=(ActivationSupport("nvfp4", "group", 16, dynamic=True),),
            per_partition_scales=True,
            input_pre_scale=True,
        ),
        *DEPLOYED_ACTIVATION_PAIRS,
    ),
    devices=(DeviceSupport(ANY_DEVICE),),
    implementation="qscheme_plugins.reference_kernel:ReferenceKernel",
    requires_modules=("torch",),
    checks=(ActivationDtypes(("bfloat16", "float16", "float32")),),
)


@hookimpl
def qscheme_kernels() -> list[KernelDeclaration]:
    return [REFERENCE]
