"""The torch reference kernel: exact dequantize-then-matmul, with exact activation emulation.

``prepare`` dequantizes the canonical weight once to float32 [N, K] (bit-identical to the
producer's own dequantization, ``qscheme.canonical.dequantize``). ``apply`` multiplies the
input by the AWQ pre-scale if any, quantizes and dequantizes it as the scheme says
(``qscheme.emulation``) when the scheme quantizes activations, and multiplies in float32. A
fused layer whose partitions carry different static input scales quantizes the shared input
once per distinct scale, each partition with its own, as separate layers would. The result is
returned in the input's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qscheme.canonical import CanonicalWeight, dequantize
from qscheme.descriptor import ActivationSpec
from qscheme.emulation import apply_pre_scale, fake_quantize_activation
from qscheme.errors import UsageError


@dataclass(frozen=True)
class InputScaling:
    """The rows [start, stop) of the output whose input is quantized with these static scales."""

    start: int
    stop: int
    input_scale: Tensor | None = None
    input_global_scale: Tensor | None = None
    input_global_scale_divisor: Tensor | None = None

    def same_scales(self, other: InputScaling) -> bool:
        pairs = (
            (self.input_scale, other.input_scale),
            (self.input_global_scale, other.input_global_scale),
            (self.input_global_scale_divisor, other.input_global_scale_divisor),
        )
        return all(
            (a is None and b is None) or (a is not None and b is not None and bool(torch.equal(a, b))) for a, b in pairs
        )


@dataclass(frozen=True)
class ReferenceState:
    """What ``prepare`` computes once: the float32 weight and how to quantize the input."""

    weight: Tensor
    k: int
    activation: ActivationSpec | None
    scalings: tuple[InputScaling, ...]
    pre_scale: Tensor | None


def _partition_value(values: Tensor | None, index: int) -> Tensor | None:
    if values is None:
        return None
    flat = values.reshape(-1)
    return flat[index].reshape(1) if flat.numel() > 1 else flat.reshape(1)


def input_scalings(weight: CanonicalWeight, device: torch.device) -> tuple[InputScaling, ...]:
    """One InputScaling per run of adjacent partitions that share their static input scales."""
    divisor = weight.input_global_scale_divisor
    partitions = weight.partitions or (weight.n,)
    runs: list[InputScaling] = []
    start = 0
    for index, size in enumerate(partitions):
        scaling = InputScaling(
            start,
            start + size,
            *(
                None if v is None else v.to(device=device, dtype=torch.float32)
                for v in (
                    _partition_value(weight.input_scale, index),
                    _partition_value(weight.input_global_scale, index),
                    _partition_value(divisor, index),
                )
            ),
        )
        if runs and runs[-1].same_scales(scaling):
            previous = runs[-1]
            runs[-1] = InputScaling(
                previous.start,
                scaling.stop,
                previous.input_scale,
                previous.input_global_scale,
                previous.input_global_scale_divisor,
            )
        else:
            runs.append(scaling)
        start += size
    return tuple(runs)


class ReferenceKernel:
    """KernelImplementation of the ``reference`` kernel (any device, every built-in scheme)."""

    def prepare(self, weight: CanonicalWeight, device: torch.device) -> ReferenceState:
        device = torch.device(device)
        dense = dequantize(weight).to(device=device, dtype=torch.float32)
        pre_scale = weight.input_pre_scale
        return ReferenceState(
            weight=dense,
            k=weight.k,
            activation=weight.scheme.activation,
            scalings=input_scalings(weight, device) if weight.scheme.activation is not None else (),
            pre_scale=None if pre_scale is None else pre_scale.to(device=device, dtype=torch.float32),
        )

    def quantize_input(self, state: ReferenceState, x: Tensor) -> list[tuple[InputScaling | None, Tensor]]:
        """The float32 input each output slice multiplies: pre-scaled, then fake-quantized."""
        values = x.to(device=state.weight.device, dtype=torch.float32)
        if state.pre_scale is not None:
            values = apply_pre_scale(values, state.pre_scale)
        if state.activation is None:
            return [(None, values)]
        return [
            (
                scaling,
                fake_quantize_activation(
                    values,
                    state.activation,
                    input_scale=scaling.input_scale,
                    input_global_scale=None
                    if scaling.input_global_scale_divisor is not None
                    else scaling.input_global_scale,
                    input_global_scale_divisor=scaling.input_global_scale_divisor,
                ),
            )
            for scaling in state.scalings
        ]

    def apply(self, state: ReferenceState, x: Tensor, bias: Tensor | None) -> Tensor:
        if x.shape[-1] != state.k:
            raise UsageError(f"input has {x.shape[-1]} features in its last dim; the layer takes K={state.k}")
        pieces = []
        for scaling, values in self.quantize_input(state, x):
            rows = state.weight if scaling is None else state.weight[scaling.start : scaling.stop]
            pieces.append(torch.matmul(values, rows.t()))
        y = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)
        if bias is not None:
            y = y + bias.to(device=y.device, dtype=torch.float32)
        return y.to(x.dtype)
