"""The old import path of ``QuantExperts`` and its companions, which live in ``qscheme.modules.experts``.

Kept for code that imports ``qscheme.experts`` and for experts modules pickled before the move.
New code imports from ``qscheme.modules``.
"""

from __future__ import annotations

from qscheme.modules.experts import (
    FUSED_GATE_UP,
    GATE_UP_FUSE,
    PROJECTIONS,
    Expert,
    ExpertsSpec,
    QuantExperts,
    find_expert_modules,
)

__all__ = [
    "FUSED_GATE_UP",
    "GATE_UP_FUSE",
    "PROJECTIONS",
    "Expert",
    "ExpertsSpec",
    "QuantExperts",
    "find_expert_modules",
]
