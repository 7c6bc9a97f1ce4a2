"""The ``cpu_int8_gemm`` kernel: ``qscheme.int8_gemm``'s loops behind the kernel interface.

``prepare`` keeps the canonical int8 codes as they are (the very tensor on the CPU) with each
row's sum of codes and its effective float32 scale (``qscheme.canonical.effective_scale``: any
global scale folded in as the producer does). ``apply`` flattens the input to [M, K], and the
extension quantizes it per token exactly as the reference kernel does and multiplies (see
``qscheme.int8_gemm``); the output is in the input's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qscheme import int8_gemm
from qscheme.canonical import CanonicalWeight
from qscheme.canonical_weight import effective_scale
from qscheme.errors import UsageError
from qscheme.int8_gemm import Int8Layer


@dataclass(frozen=True)
class CpuInt8GemmState:
    """The layer as the extension reads it."""

    layer: Int8Layer


def row_scales(weight: CanonicalWeight) -> Tensor:
    """The effective float32 scale of each of the weight's N rows ([N]), for one scale per row."""
    scale = effective_scale(weight)
    if scale.numel() == 1:
        return scale.reshape(1).expand(weight.n).contiguous()
    if scale.numel() != weight.n:
        raise UsageError(
            f"cpu_int8_gemm takes one scale per output row; scheme {weight.scheme.name} has {scale.numel()} scales "
            f"for N={weight.n} (run the layer on cpu_gemv or dequant_gemm)"
        )
    return scale.reshape(weight.n)


class CpuInt8GemmKernel:
    """KernelImplementation of ``cpu_int8_gemm`` (CPU)."""

    def prepare(self, weight: CanonicalWeight, device: torch.device) -> CpuInt8GemmState:
        device = torch.device(device)
        if device.type != "cpu":
            raise UsageError(f"cpu_int8_gemm runs on the CPU, not {device}")
        if not int8_gemm.available():
            raise UsageError(
                "cpu_int8_gemm: the C++ extension qscheme._int8_gemm is not built; reinstall qscheme with a C++17 "
                "compiler (pip install --no-build-isolation -e .)"
            )
        weight = weight.to(device)
        if weight.zero_point is not None or weight.input_pre_scale is not None or weight.input_permutation is not None:
            raise UsageError(
                f"cpu_int8_gemm takes symmetric int8 weights without pre-scales or permuted inputs; scheme "
                f"{weight.scheme.name} has them (run the layer on cpu_gemv or dequant_gemm)"
            )
        return CpuInt8GemmState(layer=int8_gemm.layer_of(weight.codes, row_scales(weight)))

    def apply(self, state: CpuInt8GemmState, x: Tensor, bias: Tensor | None) -> Tensor:
        layer = state.layer
        if x.shape[-1] != layer.k:
            raise UsageError(f"input has {x.shape[-1]} features in its last dim; the layer takes K={layer.k}")
        if x.dtype not in int8_gemm.INPUT_DTYPES:
            raise UsageError(f"cpu_int8_gemm takes bfloat16 or float32 inputs, not {x.dtype}; cast the input")
        y = int8_gemm.linear(layer, x.reshape(-1, layer.k), bias)
        return y.reshape(*x.shape[:-1], layer.n)
