"""qscheme: declarative quantization schemes, kernel resolution and exact checkpoint loading."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qscheme.catalog import Catalog, load_catalog, load_scheme
from qscheme.descriptor import Scheme, parse_scheme_file, parse_scheme_text
from qscheme.errors import (
    CheckpointError,
    FormatError,
    NoKernelError,
    PluginError,
    QSchemeError,
    QuantizeError,
    SchemeError,
    UsageError,
)

if TYPE_CHECKING:
    from qscheme.linear import QuantLinear

__version__ = "0.1.0"

__all__ = [
    "Catalog",
    "CheckpointError",
    "FormatError",
    "NoKernelError",
    "PluginError",
    "QSchemeError",
    "QuantLinear",
    "QuantizeError",
    "Scheme",
    "SchemeError",
    "UsageError",
    "__version__",
    "load_catalog",
    "load_scheme",
    "parse_scheme_file",
    "parse_scheme_text",
]


def __getattr__(name: str) -> object:
    # QuantLinear imports torch: load it on first use so that `import qscheme` stays light.
    if name == "QuantLinear":
        from qscheme.linear import QuantLinear

        return QuantLinear
    raise AttributeError(f"module 'qscheme' has no attribute {name!r}")
