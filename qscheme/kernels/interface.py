"""What a kernel implementation provides: prepare canonical tensors once, apply many times.

Implementations never see checkpoint tensor names or scale conventions: only
``qscheme.canonical.CanonicalWeight`` (see its module docstring for the exact layout).
``KernelExecutionError`` is what a layer raises when a kernel's code fails at run time.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from qscheme.canonical import CanonicalWeight
from qscheme.errors import QSchemeError


@runtime_checkable
class KernelImplementation(Protocol):
    """A kernel's code. Declarations (plain data) live elsewhere and import nothing heavy."""

    def prepare(self, weight: CanonicalWeight, device: torch.device) -> Any:
        """Turn canonical tensors into this kernel's own state (repack, swizzle, pad, move)."""
        ...

    def apply(self, state: Any, x: Tensor, bias: Tensor | None) -> Tensor:
        """y = x @ W^T (+ bias) for x of shape [..., K]; returns [..., N] in x's dtype."""
        ...


class KernelExecutionError(QSchemeError, RuntimeError):
    """A kernel's code failed on a layer at run time: ``prepare`` or ``apply`` raised (the
    original exception is chained as ``__cause__``), or ``apply`` returned something that is not
    ``[..., N]`` in the input's dtype.

    The message and the attributes name the layer, the kernel, its plugin and the scheme.
    """

    def __init__(self, message: str, *, layer: str, kernel: str, plugin: str, scheme: str, stage: str) -> None:
        super().__init__(message)
        self.layer = layer
        self.kernel = kernel
        self.plugin = plugin
        self.scheme = scheme
        self.stage = stage
