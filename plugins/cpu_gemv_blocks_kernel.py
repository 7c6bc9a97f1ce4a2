"""The ``cpu_gemv_blocks`` kernel: ``qscheme.cpu_gemv_blocks``'s C++ GEMV behind the kernel interface.

``prepare`` keeps the canonical raw blocks as they are (``qscheme.cpu_gemv_blocks.block_layout_of``:
a view, plus the scheme's compiled program, shared by its layers). ``apply`` flattens the input
to [M, K]; bfloat16 and float32 inputs go straight to the extension, which rounds the output once
to the input's dtype; float16 inputs are widened to float32 and the float32 result rounded once.
Rows of the weight are split over ``torch.get_num_threads()`` worker threads of the extension.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qscheme import cpu_gemv
from qscheme.canonical import CanonicalWeight
from qscheme.cpu_gemv_blocks import BlockGemvLayout, block_layout_of, gemv_blocks
from qscheme.errors import UsageError

DIRECT_DTYPES = (torch.bfloat16, torch.float32)  # the extension reads these inputs itself


@dataclass(frozen=True)
class CpuGemvBlocksState:
    """The extension's view of the layer."""

    layout: BlockGemvLayout

    @property
    def k(self) -> int:
        return self.layout.k


class CpuGemvBlocksKernel:
    """KernelImplementation of ``cpu_gemv_blocks`` (CPU)."""

    def prepare(self, weight: CanonicalWeight, device: torch.device) -> CpuGemvBlocksState:
        device = torch.device(device)
        if device.type != "cpu":
            raise UsageError(f"cpu_gemv_blocks runs on the CPU, not {device}")
        if not cpu_gemv.available():
            raise UsageError(
                "cpu_gemv_blocks: the C++ extension qscheme._cpu_gemv is not built; reinstall qscheme with a C++17 "
                "compiler (pip install --no-build-isolation -e .)"
            )
        return CpuGemvBlocksState(block_layout_of(weight.to(device)))

    def apply(self, state: CpuGemvBlocksState, x: Tensor, bias: Tensor | None) -> Tensor:
        if x.shape[-1] != state.k:
            raise UsageError(f"input has {x.shape[-1]} features in its last dim; the layer takes K={state.k}")
        rows = x.reshape(-1, state.k)
        layout = state.layout
        if x.dtype in DIRECT_DTYPES:
            y = gemv_blocks(layout, rows, bias)
        else:
            y = gemv_blocks(layout, rows.to(torch.float32), bias).to(x.dtype)
        return y.reshape(*x.shape[:-1], layout.n)
