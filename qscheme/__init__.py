"""qscheme: declarative quantization schemes, kernel resolution and exact checkpoint loading."""

from __future__ import annotations

from typing import TYPE_CHECKING

# Registers each producer's detect rule with the descriptor parser (qscheme.descriptor.rules)
# before any descriptor is parsed: every qscheme module runs this file first. Torch-free.
import qscheme.producers  # noqa: F401
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
from qscheme.version import __version__

if TYPE_CHECKING:
    from qscheme.checkpoint.load import Checkpoint, load_checkpoint
    from qscheme.checkpoint.model import apply_to_model
    from qscheme.dequantize import dequantize_weight
    from qscheme.modules.linear import QuantLinear
    from qscheme.quantize import quantize_weight
    from qscheme.writing import WriteSummary, convert_checkpoint, quantize_checkpoint

__all__ = [
    "Catalog",
    "Checkpoint",
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
    "WriteSummary",
    "__version__",
    "apply_to_model",
    "convert_checkpoint",
    "dequantize_weight",
    "load_catalog",
    "load_checkpoint",
    "load_scheme",
    "parse_scheme_file",
    "parse_scheme_text",
    "quantize_checkpoint",
    "quantize_weight",
]


# Names whose modules import torch: loaded on first use so that `import qscheme` stays light.
_LAZY: dict[str, str] = {
    "QuantLinear": "qscheme.modules.linear",
    "Checkpoint": "qscheme.checkpoint.load",
    "load_checkpoint": "qscheme.checkpoint.load",
    "apply_to_model": "qscheme.checkpoint.model",
    "quantize_weight": "qscheme.quantize",
    "dequantize_weight": "qscheme.dequantize",
    "quantize_checkpoint": "qscheme.writing.quantize",
    "convert_checkpoint": "qscheme.writing.convert",
    "WriteSummary": "qscheme.writing.summary",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'qscheme' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


def _register_with_transformers() -> None:
    """Register qscheme's transformers quantizers now if transformers' quantizer registry is loaded,
    else as soon as it loads (an import hook: ``import qscheme`` never imports transformers)."""
    from qscheme._transformers_hook import install

    install()


_register_with_transformers()
