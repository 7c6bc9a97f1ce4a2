"""Marlin (weight-only FP4, int4, int8 and fp8 with 16-bit activations): declaration only.

Capabilities as vLLM's Marlin kernels have them (see shared formats.md, "Kernels in the
field"): compute capability 7.5 or newer, 16-bit activations only, N % 64 == 0 and
K % 128 == 0 (or N % 128 == 0 and K % 64 == 0), int group sizes channel/32/64/128, FP4 groups
of 16 (NVFP4) and 32 (MXFP4), one global scale per layer. The kernel code ships in vLLM, so
the module is required; no qscheme implementation exists yet.
"""

from __future__ import annotations

from qscheme.kernels.declaration import (
    ActivationDtypes,
    CapabilityRange,
    DeviceSupport,
    KernelDeclaration,
    ShapeAlignment,
    Supports,
)
from qscheme.plugins import hookimpl

MARLIN = KernelDeclaration(
    name="marlin",
    provider="vllm",
    priority=80,
    description="Marlin mixed-precision GEMM (weights repacked into Marlin tiles at load time)",
    supports=(
        Supports(weights=("nvfp4",), granularities=("group",), group_sizes=(16,), scale_formats=("e4m3",)),
        Supports(weights=("mxfp4",), granularities=("group",), group_sizes=(32,), scale_formats=("e8m0",)),
        Supports(weights=("int4",), granularities=("channel", "group"), group_sizes=(32, 64, 128), zero_points=True),
        Supports(weights=("int8",), granularities=("channel", "group"), group_sizes=(32, 64, 128)),
        Supports(weights=("fp8",), granularities=("tensor", "channel")),
    ),
    devices=(DeviceSupport("cuda", capabilities=(CapabilityRange((7, 5)),)),),
    implementation=None,
    requires_modules=("vllm",),
    checks=(ShapeAlignment(((64, 128), (128, 64))), ActivationDtypes(("bfloat16", "float16"))),
)


@hookimpl
def qscheme_kernels() -> list[KernelDeclaration]:
    return [MARLIN]
