"""qscheme's out-of-tree quantization method for vLLM (docs/vllm.md).

vLLM loads it through the ``vllm.general_plugins`` entry point (``qscheme.vllm.plugin:register``),
which registers the quantization method ``qscheme``: checkpoints whose config says
``quant_method: qscheme`` select it by themselves, and any checkpoint qscheme reads runs through it
with ``LLM(..., quantization="qscheme")``.

Importing this package imports nothing of vLLM (``import qscheme`` never does): the modules that
subclass vLLM's classes (``config``, ``linear_method``, ``moe_method``, ``params``) are imported by ``register``,
inside vLLM's own processes. ``versions`` (the supported vLLM range, as data) needs no vLLM.
"""

from __future__ import annotations

from qscheme.vllm.versions import SUPPORTED_VLLM, VllmVersionError, check_vllm_version

__all__ = ["SUPPORTED_VLLM", "VllmVersionError", "check_vllm_version"]
