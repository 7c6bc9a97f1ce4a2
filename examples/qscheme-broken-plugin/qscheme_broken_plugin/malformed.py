"""A plugin whose hooks return things that are not declarations or descriptor paths."""

from __future__ import annotations

from qscheme.plugins import hookimpl


@hookimpl
def qscheme_kernels() -> list[object]:
    return ["not a KernelDeclaration", {"name": "neither is a dict"}]


@hookimpl
def qscheme_schemes() -> list[object]:
    return ["/nonexistent/qscheme-broken-plugin/schemes", 42]
