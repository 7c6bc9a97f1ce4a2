"""The old import path of QuantLinear's torch custom ops, which live in ``qscheme.modules.ops``.

Importing it registers nothing a second time: the ops (``qscheme::quant_linear``,
``qscheme::quant_linear_input_grad``) are registered once, by ``qscheme.modules.ops``.
"""

from __future__ import annotations

from qscheme.modules.ops import handle_for, layer_for, quant_linear, quant_linear_input_grad

__all__ = ["handle_for", "layer_for", "quant_linear", "quant_linear_input_grad"]
