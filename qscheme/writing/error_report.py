"""How far quantization moved a layer's weight: relative (Frobenius) and largest absolute error.

``relative`` is ``||W - Q(W)||_F / ||W||_F``: the Frobenius norm (the square root of the sum of
squared elements) of the difference between the reference weight ``W`` (quantize: the source
weight; a requantizing convert: the source's dequantized weight) and the dequantized result
``Q(W)``, divided by that of ``W``; 0 when both are zero (an all-zero weight quantizes exactly),
None when only ``W`` is (no relative figure exists).
``max_abs`` is ``max |W - Q(W)|``. Both from float32 differences, computed a slab of rows at a
time so that no float32 copy of the whole weight is held; each slab's sums are taken in float32
(BLAS), and the slabs' added in float64: a few float32 roundings' worth of relative accuracy
(about 1e-6), ample for a report. The report costs about as much as quantizing the layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from qscheme.canonical import CanonicalWeight, dequantize_rows

SLAB_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class ErrorReport:
    """A layer's quantization error (see the module docstring)."""

    relative: float | None
    max_abs: float


def compare_weights(reference: Tensor, approximation: Tensor) -> ErrorReport:
    """The error of ``approximation`` against ``reference`` (same shape, any float dtypes)."""
    sums = ErrorSums()
    sums.add(reference, approximation)
    return sums.report()


def quantization_error(reference: Tensor, weight: CanonicalWeight) -> ErrorReport:
    """The error of the quantized ``weight`` (dequantized slab by slab) against ``reference`` [N, K]."""
    sums = ErrorSums()
    step = max(1, SLAB_ELEMENTS // max(1, weight.k))
    for start in range(0, weight.n, step):
        stop = min(weight.n, start + step)
        sums.add(reference[start:stop], dequantize_rows(weight, start, stop))
    return sums.report()


class ErrorSums:
    """Squared norms and the largest difference, added slab by slab (``add``), then reported."""

    def __init__(self) -> None:
        self.difference = 0.0
        self.reference = 0.0
        self.max_abs = 0.0

    def add(self, reference: Tensor, approximation: Tensor) -> None:
        if reference.numel() == 0:
            return
        # four passes over the slab: the float32 difference, its squared norm and extremes, and the
        # reference's norm (upcast inside the reduction); sums per slab in float32, added in float64
        difference = torch.sub(approximation.to(torch.float32), reference).reshape(-1)
        self.difference += float(torch.dot(difference, difference))
        low, high = torch.aminmax(difference)
        self.max_abs = max(self.max_abs, -float(low), float(high))
        self.reference += float(torch.linalg.vector_norm(reference, dtype=torch.float32)) ** 2

    def report(self) -> ErrorReport:
        relative: float | None
        if self.reference == 0.0:
            relative = 0.0 if self.difference == 0.0 else None
        else:
            relative = math.sqrt(self.difference) / math.sqrt(self.reference)
        return ErrorReport(relative, self.max_abs)
