"""The example kernel's code: prepare dequantizes once, apply is a float32 matmul."""

from __future__ import annotations

import torch
from torch import Tensor

from qscheme.canonical import CanonicalWeight, dequantize


class DequantMatmulKernel:
    """A trivially correct KernelImplementation: state = the float32 [N, K] weight."""

    def prepare(self, weight: CanonicalWeight, device: torch.device) -> Tensor:
        return dequantize(weight).to(device=device, dtype=torch.float32)

    def apply(self, state: Tensor, x: Tensor, bias: Tensor | None) -> Tensor:
        y = torch.matmul(x.to(device=state.device, dtype=torch.float32), state.t())
        if bias is not None:
            y = y + bias.to(device=y.device, dtype=torch.float32)
        return y.to(x.dtype)
