"""The ``vllm.general_plugins`` entry point: ``register`` makes ``qscheme`` a quantization method.

vLLM calls every general plugin in each of its processes (the front end and the engine core)
before it reads a model's config; calling ``register`` again does nothing more.
"""

from __future__ import annotations

import importlib

from qscheme.vllm.versions import check_vllm_version

METHOD = "qscheme"
"""The quantization method's name: ``LLM(..., quantization="qscheme")``; ``quant_method: qscheme``."""


def register() -> None:
    """Register the ``qscheme`` quantization method with vLLM; VllmVersionError outside ``SUPPORTED_VLLM``."""
    check_vllm_version()
    # the module registers its config class when imported (vLLM's register_quantization_config)
    importlib.import_module("qscheme.vllm.config")
