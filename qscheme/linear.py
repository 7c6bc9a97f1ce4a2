"""The old import path of ``QuantLinear`` and its companions, which live in ``qscheme.modules``.

Kept because the docs and users write ``from qscheme.linear import QuantLinear``, and so that
layers pickled before the move (whose pickles name ``qscheme.linear.QuantLinear`` and
``qscheme.linear._Layout``) still load. New code imports from ``qscheme.modules``.
"""

from __future__ import annotations

from qscheme.modules.device import DEVICE_FORMS, checked_device
from qscheme.modules.failures import KernelRouteWarning
from qscheme.modules.linear import BUFFER_PREFIX, HOST_DEVICES, QuantLinear
from qscheme.modules.linear import _Layout as _Layout  # named by pickles of layers saved before the move
from qscheme.modules.problem import problem_for
from qscheme.modules.weight import QuantizedWeight, QuantizedWeightError

__all__ = [
    "BUFFER_PREFIX",
    "DEVICE_FORMS",
    "HOST_DEVICES",
    "KernelRouteWarning",
    "QuantLinear",
    "QuantizedWeight",
    "QuantizedWeightError",
    "checked_device",
    "problem_for",
]
