"""What a kernel implementation provides: prepare canonical tensors once, apply many times.

Implementations never see checkpoint tensor names or scale conventions: only
``qscheme.canonical.CanonicalWeight`` (see its module docstring for the exact layout).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from qscheme.canonical import CanonicalWeight


@runtime_checkable
class KernelImplementation(Protocol):
    """A kernel's code. Declarations (plain data) live elsewhere and import nothing heavy."""

    def prepare(self, weight: CanonicalWeight, device: torch.device) -> Any:
        """Turn canonical tensors into this kernel's own state (repack, swizzle, pad, move)."""
        ...

    def apply(self, state: Any, x: Tensor, bias: Tensor | None) -> Tensor:
        """y = x @ W^T (+ bias) for x of shape [..., K]; returns [..., N] in x's dtype."""
        ...
