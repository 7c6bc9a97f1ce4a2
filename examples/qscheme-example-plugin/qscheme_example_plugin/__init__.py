"""An example qscheme plugin: a kernel declaration and a scheme descriptor, through two hooks.

This module is imported when qscheme loads its plugins, so it stays light: the declaration is
plain data, and the kernel's code (``qscheme_example_plugin.kernel``) is imported only when a
layer is resolved to it.
"""

from __future__ import annotations

import os
from pathlib import Path

from qscheme.kernels.declaration import (
    ANY_DEVICE,
    WEIGHT_ONLY,
    ActivationDtypes,
    DeviceSupport,
    KernelDeclaration,
    Supports,
)
from qscheme.plugins import hookimpl

PRIORITY_VARIABLE = "QSCHEME_EXAMPLE_PRIORITY"
DEFAULT_PRIORITY = -10  # below the built-in reference kernel (0): installed, it changes nothing


def declaration() -> KernelDeclaration:
    """The kernel's declaration; its priority comes from QSCHEME_EXAMPLE_PRIORITY if set."""
    return KernelDeclaration(
        name="example_dequant",
        provider="qscheme-example-plugin",
        priority=int(os.environ.get(PRIORITY_VARIABLE, DEFAULT_PRIORITY)),
        description="example: dequantize once, then a float32 matmul (weight-only schemes)",
        supports=(
            Supports(
                weights=("nvfp4", "mxfp4", "fp4", "int4", "int8", "fp8"),
                activations=(WEIGHT_ONLY,),
                zero_points=True,
                per_partition_scales=True,
            ),
        ),
        devices=(DeviceSupport(ANY_DEVICE),),
        implementation="qscheme_example_plugin.kernel:DequantMatmulKernel",
        checks=(ActivationDtypes(("bfloat16", "float16", "float32")),),
    )


@hookimpl
def qscheme_kernels() -> list[KernelDeclaration]:
    return [declaration()]


@hookimpl
def qscheme_schemes() -> list[Path]:
    return [Path(__file__).parent / "schemes"]
