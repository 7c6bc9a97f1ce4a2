"""The ``cpu_gemv_blocks`` kernel: ``qscheme.cpu_gemv_blocks``'s C++ GEMV behind the kernel interface,
and the ``cpu_gemm_blocks`` kernel: its fused GEMM (``qscheme.cpu_gemv_blocks.gemm``) for larger batches.

``prepare`` keeps the canonical raw blocks as they are (``qscheme.cpu_gemv_blocks.block_layout_of``:
a view, plus the scheme's compiled program, shared by its layers). ``apply`` flattens the input
to [M, K]; bfloat16 and float32 inputs go straight to the extension, which rounds the output once
to the input's dtype; float16 inputs are widened to float32 and the float32 result rounded once.
Rows of the weight are split over ``torch.get_num_threads()`` worker threads of the extension.

``cpu_gemm_blocks`` keeps the same state (the blocks as they are) and takes bfloat16 inputs only; its
``prepare`` refuses a layout the GEMM's decoder does not read, so that a layer it cannot run is never
built on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qscheme import cpu_gemv
from qscheme.canonical import CanonicalWeight
from qscheme.cpu_gemv_blocks import BlockGemvLayout, block_layout_of, gemm, gemm_runs, gemv_blocks
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


class CpuGemmBlocksKernel:
    """KernelImplementation of ``cpu_gemm_blocks`` (CPU, bfloat16 inputs)."""

    def prepare(self, weight: CanonicalWeight, device: torch.device) -> CpuGemvBlocksState:
        state = CpuGemvBlocksKernel().prepare(weight, device)
        if not gemm_runs(state.layout):
            raise UsageError(
                f"cpu_gemm_blocks does not run scheme {weight.scheme.name} here: its blocks do not fit the GEMM's "
                "vector decoder, or this CPU does not run it (AVX512-BF16, VBMI and the AVX-512 loops); force "
                "kernel='dequant_gemm' (or 'cpu_gemv_blocks') for this layer"
            )
        return state

    def apply(self, state: CpuGemvBlocksState, x: Tensor, bias: Tensor | None) -> Tensor:
        if x.shape[-1] != state.k:
            raise UsageError(f"input has {x.shape[-1]} features in its last dim; the layer takes K={state.k}")
        if x.dtype != torch.bfloat16:
            raise UsageError(f"cpu_gemm_blocks takes bfloat16 inputs, not {x.dtype}; dequant_gemm takes the others")
        layout = state.layout
        y = gemm(layout, x.reshape(-1, state.k), bias)
        return y.reshape(*x.shape[:-1], layout.n)
