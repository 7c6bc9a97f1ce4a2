"""The plugin contract: two hooks, both called without arguments.

A plugin is any module or object with functions marked ``@hookimpl`` whose names are these
hooks. It is found through the ``qscheme`` entry-point group, or registered in-process with
``qscheme.plugins.register_plugin``. The built-in kernels register exactly the same way.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from qscheme.kernels.declaration import KernelDeclaration

PROJECT_NAME = "qscheme"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def qscheme_kernels() -> Iterable[KernelDeclaration]:  # type: ignore[empty-body]
    """Kernel declarations this plugin contributes (plain data; import no kernel code here).

    Each declaration names its implementation as "module:attribute"; that module is imported
    only when a layer is resolved to the kernel.
    """


@hookspec
def qscheme_schemes() -> Iterable[str | Path]:  # type: ignore[empty-body]
    """Scheme descriptor files (*.yaml), or folders holding them, that this plugin ships."""
