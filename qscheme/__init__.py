"""qscheme: declarative quantization schemes, kernel resolution and exact checkpoint loading."""

from __future__ import annotations

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

__version__ = "0.1.0"

__all__ = [
    "Catalog",
    "CheckpointError",
    "FormatError",
    "NoKernelError",
    "PluginError",
    "QSchemeError",
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
