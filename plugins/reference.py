"""The torch reference kernel's declaration: every scheme on any device, at the lowest priority.

Weight-only schemes run as dequantize-then-matmul; schemes that quantize activations run with
an exact quantize-dequantize emulation of the pairs deployed kernels run, declared with the
element and scale formats ``qscheme.emulation.SUPPORTED_ACTIVATIONS`` emulates (so a scheme
with e5m2 or uint8 inputs, or 16-bit dynamic scales, is rejected at resolution rather than at
its first forward). The code is in ``qscheme_plugins.reference_kernel`` and is imported only
when a layer uses it. Packed blocks (GGUF's types) are decoded chunk by chunk of rows as their
descriptors declare (``qscheme.formats.blocks``).
"""

from __future__ import annotations

from dataclasses import replace

from qscheme.kernels.declaration import (
    ANY_DEVICE,
    ANY_WEIGHT_ONLY,
    BLOCKS_WEIGHT_ONLY,
    CODEBOOK_WEIGHT_ONLY,
    DEPLOYED_ACTIVATION_PAIRS,
    NVFP4_ACTIVATION_PAIR,
    ActivationDtypes,
    DeviceSupport,
    KernelDeclaration,
    PreparedState,
)
from qscheme.plugins import hookimpl

REFERENCE = KernelDeclaration(
    name="reference",
    provider="qscheme",
    priority=0,
    description="torch dequantize-then-matmul in float32, with exact activation quantization emulation",
    # Every entry takes per-partition scales (canonical dequantization handles them) and AWQ
    # pre-scales (applied before the activation is quantized); weight-only layers also permuted
    # input channels (GPTQ act-order: dequantization returns the weight in the input's order).
    supports=(
        replace(ANY_WEIGHT_ONLY, input_permutation=True),
        BLOCKS_WEIGHT_ONLY,
        CODEBOOK_WEIGHT_ONLY,
        NVFP4_ACTIVATION_PAIR,
        *DEPLOYED_ACTIVATION_PAIRS,
    ),
    devices=(DeviceSupport(ANY_DEVICE),),
    implementation="qscheme_plugins.reference_kernel:ReferenceKernel",
    requires_modules=("torch",),
    checks=(ActivationDtypes(("bfloat16", "float16", "float32")),),
    # the canonical weight as it is (QSCHEME_REFERENCE_CACHE=1 adds a dequantized copy on request)
    prepared_state=PreparedState("canonical"),
)


@hookimpl
def qscheme_kernels() -> list[KernelDeclaration]:
    return [REFERENCE]
