"""A plugin that loads and declares its kernels fine, but whose kernel code cannot be used.

Each kernel fails in one of the ways a real package's code does when it is imported:

- ``broken_dependency``: its module exists, but importing it raises (a library it needs is
  not installed);
- ``broken_missing_class``: its module imports, but has no attribute of the declared name;
- ``broken_interface``: the class exists but lacks ``apply`` (it does not implement the
  kernel interface).

Their priorities are above every built-in kernel's, so each would be chosen if its code
worked: qscheme must reject them all at resolution, with the import error as the reason, in
`qscheme kernels`, `qscheme resolve` and `qscheme run`, and go on to a kernel that works.
"""

from __future__ import annotations

from qscheme.kernels.declaration import (
    ANY_DEVICE,
    WEIGHT_ONLY,
    ActivationDtypes,
    DeviceSupport,
    KernelDeclaration,
    Supports,
)
from qscheme.plugins import hookimpl

WEIGHT_ONLY_SCHEMES = Supports(
    weights=("nvfp4", "mxfp4", "fp4", "int4", "int8", "fp8"),
    activations=(WEIGHT_ONLY,),
    zero_points=True,
    per_partition_scales=True,
)

# (name, priority, implementation, what is wrong with it)
BROKEN = (
    (
        "broken_dependency",
        1002,
        "qscheme_broken_plugin.needs_missing_library:Kernel",
        "its module imports a library that is not installed",
    ),
    (
        "broken_missing_class",
        1001,
        "qscheme_broken_plugin.kernels:MissingKernel",
        "its module has no such class",
    ),
    (
        "broken_interface",
        1000,
        "qscheme_broken_plugin.kernels:PrepareOnlyKernel",
        "its class has prepare but no apply",
    ),
)


def declarations() -> list[KernelDeclaration]:
    return [
        KernelDeclaration(
            name=name,
            provider="qscheme-broken-plugin",
            priority=priority,
            description=f"broken on purpose: {why}",
            supports=(WEIGHT_ONLY_SCHEMES,),
            devices=(DeviceSupport(ANY_DEVICE),),
            implementation=implementation,
            checks=(ActivationDtypes(("bfloat16", "float16", "float32")),),
        )
        for name, priority, implementation, why in BROKEN
    ]


@hookimpl
def qscheme_kernels() -> list[KernelDeclaration]:
    return declarations()
