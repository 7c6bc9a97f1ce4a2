"""The Triton fallback kernel's code (its declaration is ``qscheme_plugins.triton_declaration``).

``prepare`` puts the canonical tensors in the kernels' layout (``qscheme.triton.linear``);
``apply`` runs the activation pre-pass when the scheme quantizes its inputs, then the GEMM that
decodes the weights in registers. Every scheme the descriptors can express runs here with no
scheme-specific code: the kernels are specialised from the descriptor (``qscheme.triton.spec``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from qscheme.canonical import CanonicalWeight
from qscheme.triton.linear import PreparedWeight, linear, prepare_weight


class TritonKernel:
    """KernelImplementation of the ``triton`` kernel."""

    def prepare(self, weight: CanonicalWeight, device: torch.device) -> PreparedWeight:
        return prepare_weight(weight, device)

    def apply(self, state: PreparedWeight, x: Tensor, bias: Tensor | None) -> Tensor:
        return linear(state, x, bias)
