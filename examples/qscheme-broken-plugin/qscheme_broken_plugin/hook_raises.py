"""A plugin that imports fine but whose hook raises."""

from __future__ import annotations

from qscheme.plugins import hookimpl


@hookimpl
def qscheme_kernels() -> list[object]:
    raise RuntimeError("the broken-hook example plugin failed on purpose")
