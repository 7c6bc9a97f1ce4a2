"""The torch modules a user holds: ``QuantLinear``, its ``weight`` stand-in, ``QuantExperts``.

Below the checkpoint loader: these modules are built from a scheme and tensors (``from_tensors``)
or from canonical tensors (``from_canonical``), and import nothing of ``qscheme.checkpoint``,
``qscheme.parallel``, ``qscheme.writing`` or ``qscheme.transformers``; the loader builds them.

- ``linear``: ``QuantLinear``, one quantized linear layer: resolves its kernel, runs it.
- ``weight``: ``QuantizedWeight``, what ``QuantLinear.weight`` gives (metadata, no values).
- ``experts``: ``QuantExperts``, quantized fused mixture-of-experts layers.
- ``ops``: the torch custom ops (``qscheme::quant_linear``) that torch.compile sees.
- ``failures``: the typed errors of a kernel that misbehaves, ``KernelRouteWarning``.
- ``device``: ``checked_device``, the ``device=`` argument checked.
- ``problem``: ``problem_for``, the resolver's view of one canonical layer.

Importing this package imports torch.
"""

from __future__ import annotations

from qscheme.modules.device import DEVICE_FORMS, checked_device
from qscheme.modules.experts import (
    FUSED_GATE_UP,
    GATE_UP_FUSE,
    PROJECTIONS,
    Expert,
    ExpertsSpec,
    QuantExperts,
    find_expert_modules,
)
from qscheme.modules.failures import KernelRouteWarning
from qscheme.modules.linear import QuantLinear, set_m_split
from qscheme.modules.ops import handle_for, layer_for
from qscheme.modules.problem import problem_for
from qscheme.modules.weight import QuantizedWeight, QuantizedWeightError

__all__ = [
    "DEVICE_FORMS",
    "FUSED_GATE_UP",
    "GATE_UP_FUSE",
    "PROJECTIONS",
    "Expert",
    "ExpertsSpec",
    "KernelRouteWarning",
    "QuantExperts",
    "QuantLinear",
    "QuantizedWeight",
    "QuantizedWeightError",
    "checked_device",
    "find_expert_modules",
    "handle_for",
    "layer_for",
    "problem_for",
    "set_m_split",
]
