"""What a producer's rule set decides, and the registry of rule sets.

A rule set turns a weight into scales (and zero points) and says how each element is scaled
before rounding, mirroring one producer's arithmetic (operation order and dtypes). It never
looks at a scheme's name: everything it needs is in the ``WeightPlan`` built from the
descriptor. Packing, dtypes, shapes and conventions of the stored tensors are the writer's job.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from qscheme.descriptor import Scheme
from qscheme.errors import QuantizeError
from qscheme.formats import ElementFormat
from qscheme.quantize.observe import ScaleLayout

ScaleElements = Callable[[Tensor, Tensor, "Tensor | None"], Tensor]
"""(weight tiles, scale tiles, zero-point tiles or None) -> the values to round."""


def divide_then_add_zero_point(tiles: Tensor, scale: Tensor, zero_point: Tensor | None) -> Tensor:
    """``tiles / scale + zero_point``: how both producers scale elements before rounding."""
    scaled = tiles / scale
    if zero_point is not None:
        scaled += zero_point.to(scaled.dtype)
    return scaled


@dataclass(frozen=True)
class WeightPlan:
    """Everything about one layer's weight that the rules may use."""

    scheme: Scheme
    n: int
    k: int
    dtype: torch.dtype  # the weight's dtype
    element: ElementFormat
    scale_format: str  # e4m3, e8m0, fp32, fp16, bf16 or float
    layout: ScaleLayout
    has_global_scale: bool
    has_zero_point: bool
    float_scale_dtype: torch.dtype  # the stored dtype of a float scale
    activation_format: str | None  # the input's element format (None for 16-bit inputs)


@dataclass(frozen=True)
class GivenScales:
    """Weight scales supplied by the caller, as stored in a checkpoint of the scheme."""

    scale: Tensor | None = None
    global_scale: Tensor | None = None  # in the descriptor's stored convention


@dataclass(frozen=True)
class WeightParameters:
    """A rule set's decisions for one weight."""

    stored_scale: Tensor  # [scale rows, scale columns]: float8_e4m3fn, uint8 e8m0 bytes or a float dtype
    division_scale: Tensor  # what the producer divides the weight by, per scale (dtype as the producer has it)
    scale_elements: ScaleElements
    ties: str  # see qscheme.quantize.rounding
    sign_of_zero: str
    global_scale: Tensor | None = None  # float32 [1]
    global_convention: str | None = None  # "multiplier" or "reciprocal": how ``global_scale`` is meant
    zero_point: Tensor | None = None  # int8 [scale rows, scale columns], in the element's own domain


class QuantizationRules(Protocol):
    """A producer's arithmetic: ``compressed-tensors`` and ``modelopt`` are built in."""

    name: str

    def preferred_float_scale_dtype(self, weight_dtype: torch.dtype) -> torch.dtype:
        """The dtype this producer stores float scales in."""
        ...

    def parameters(self, plan: WeightPlan, padded: Tensor, given: GivenScales) -> WeightParameters:
        """Scales, zero points and the element scaling for the zero-padded weight."""
        ...


_RULES: dict[str, QuantizationRules] = {}


def register_rules(rules: QuantizationRules) -> QuantizationRules:
    """Make a rule set available to schemes whose ``rules`` names it."""
    _RULES[rules.name] = rules
    return rules


def get_rules(name: str) -> QuantizationRules:
    """The rule set called ``name``; QuantizeError listing the known ones otherwise."""
    if name not in _RULES:
        known = ", ".join(sorted(_RULES))
        raise QuantizeError(f"no quantization rules named {name!r}; known rule sets: {known}")
    return _RULES[name]


def replace_zero_scales(scale: Tensor, eps: float) -> Tensor:
    """``scale`` with exact zeros replaced by ``eps`` (a zero scale would divide by zero)."""
    return torch.where(scale == 0, eps, scale)


def require_finite(minimum: Tensor, maximum: Tensor, plan: WeightPlan) -> None:
    if not (bool(torch.isfinite(minimum).all()) and bool(torch.isfinite(maximum).all())):
        raise QuantizeError(
            f"scheme {plan.scheme.name}: the {plan.n}x{plan.k} weight holds NaN or infinite values; "
            "quantize only finite weights"
        )
