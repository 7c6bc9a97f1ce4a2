"""Plugins: kernels and scheme descriptors contributed through pluggy hooks.

See docs/plugins.md. The contract is ``hookspecs`` (``qscheme_kernels``, ``qscheme_schemes``);
loading, fault isolation and reports are in ``manager``.
"""

from __future__ import annotations

from qscheme.plugins.hookspecs import hookimpl, hookspec
from qscheme.plugins.manager import (
    ALLOW_VARIABLE,
    BUILTIN_PLUGINS,
    DISABLE_AUTOLOAD_VARIABLE,
    ENTRY_POINT_GROUP,
    STRICT_VARIABLE,
    PluginFailure,
    PluginInfo,
    Plugins,
    get_plugins,
    kernel_declarations,
    load_plugins,
    plugin_failures,
    plugin_scheme_files,
    register_plugin,
    reset_plugins,
    unregister_plugin,
)

__all__ = [
    "ALLOW_VARIABLE",
    "BUILTIN_PLUGINS",
    "DISABLE_AUTOLOAD_VARIABLE",
    "ENTRY_POINT_GROUP",
    "STRICT_VARIABLE",
    "PluginFailure",
    "PluginInfo",
    "Plugins",
    "get_plugins",
    "hookimpl",
    "hookspec",
    "kernel_declarations",
    "load_plugins",
    "plugin_failures",
    "plugin_scheme_files",
    "register_plugin",
    "reset_plugins",
    "unregister_plugin",
]
