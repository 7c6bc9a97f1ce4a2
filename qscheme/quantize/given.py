"""Scales given to ``quantize_weight``: checked, then put in the form the rules and the writer take.

The caller gives scales by their checkpoint names, in the form a checkpoint stores them. None is
used unchecked:

- a weight scale must have a shape the descriptor declares for the weight's N and K (nothing is
  reshaped from another layout), a float dtype (uint8 bytes for e8m0), and values finite and
  > 0, both as given and in the dtype it is stored in;
- a global scale must be one finite value > 0;
- a static activation scale, activation global scale or pre-quantization scale must be a float
  tensor holding as many values as declared, finite and > 0 as given and as stored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from qscheme.api_checks import require_tensor
from qscheme.descriptor import TensorSpec
from qscheme.errors import QuantizeError
from qscheme.quantize.checks import META_FIX, require_positive, require_storable
from qscheme.quantize.rules import GivenScales, QuantizationRules, WeightPlan
from qscheme.quantize.write import allowed_dtype, stored_shape


def split_given(
    plan: WeightPlan, rules: QuantizationRules, given: Mapping[str, object], device: torch.device
) -> tuple[GivenScales, dict[str, Tensor]]:
    """Given tensors -> (weight scales in their stored form, activation tensors ready to write)."""
    scheme, weight = plan.scheme, plan.scheme.weight
    inputs: dict[str, tuple[TensorSpec, torch.dtype, str]] = {}
    activation = scheme.activation
    if activation is not None and activation.scale is not None:
        spec = activation.scale.tensor
        fix = f"give the calibrated activation scale a checkpoint stores ({_convention(activation.scale.stored)})"
        inputs[spec.name] = (spec, rules.preferred_float_scale_dtype(plan.dtype), fix)
    if activation is not None and activation.global_scale is not None:
        spec = activation.global_scale.tensor
        fix = (
            "give the calibrated activation global scale a checkpoint stores "
            f"({_convention(activation.global_scale.stored)})"
        )
        inputs[spec.name] = (spec, torch.float32, fix)
    if scheme.input_pre_scale is not None:
        fix = "give the positive per-input-channel factors the weight was smoothed with (AWQ)"
        inputs[scheme.input_pre_scale.name] = (scheme.input_pre_scale, plan.dtype, fix)
    allowed = [weight.scale.tensor.name] + ([weight.global_scale.tensor.name] if weight.global_scale else [])
    allowed += list(inputs)
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise QuantizeError(
            f"scheme {scheme.name}: cannot take {', '.join(repr(name) for name in unknown)}; the scales it can "
            f"be given are {', '.join(repr(name) for name in allowed)}"
        )
    scale = given.get(weight.scale.tensor.name)
    if scale is not None and plan.has_zero_point:
        raise QuantizeError(
            f"scheme {scheme.name}: a given weight scale needs its zero points too; "
            "leave the scale out to have both computed"
        )
    weight_scale = None if scale is None else _weight_scale(plan, scale).to(device)
    global_scale = None
    if weight.global_scale is not None and weight.global_scale.tensor.name in given:
        name = weight.global_scale.tensor.name
        global_scale = _global_scale(plan, weight.global_scale.tensor, weight.global_scale.stored, given[name])
        global_scale = global_scale.to(device)
    written = {
        name: _input(plan, spec, given[name], preferred, fix).to(device)
        for name, (spec, preferred, fix) in inputs.items()
        if name in given
    }
    return GivenScales(scale=weight_scale, global_scale=global_scale), written


def _convention(stored: str) -> str:
    return "a multiplier" if stored == "multiplier" else "a divisor, the reciprocal of the multiplier"


def _tensor(plan: WeightPlan, name: str, value: object) -> Tensor:
    fix = "give the scale as the tensor a checkpoint stores"
    return require_tensor(value, f"scheme {plan.scheme.name}", f"the given {name}", fix, META_FIX).detach()


def _weight_scale(plan: WeightPlan, given: object) -> Tensor:
    """A given weight scale, checked, as [scale rows, scale columns] in the dtype the rules take."""
    scheme, spec = plan.scheme, plan.scheme.weight.scale
    name = spec.tensor.name
    value = _tensor(plan, name, given)
    rows, columns = plan.layout.scale_shape
    declared = spec.tensor.expected_shapes(plan.n, plan.k)
    allowed = [shape for shape in declared if math.prod(shape) == rows * columns] or declared
    if tuple(value.shape) not in allowed:
        raise QuantizeError(
            f"scheme {scheme.name}: the given {name} has shape {list(value.shape)}; for a {plan.n}x{plan.k} weight "
            f"it must be {' or '.join(str(list(shape)) for shape in allowed)} (declared "
            f"{spec.tensor.describe_shapes()}): give the scales in the shape a checkpoint stores them"
        )
    fix = f"give the scales a checkpoint of the scheme stores, or leave {name} out to have it computed"
    if spec.format == "e8m0":
        if value.dtype != torch.uint8:
            raise QuantizeError(
                f"scheme {scheme.name}: {name} holds e8m0 bytes (uint8), got {value.dtype}; give the stored "
                "bytes (log2 of each scale + 127)"
            )
        require_positive(value, scheme, f"the given {name}", fix)
        return _oriented(value, spec.tensor.transposed).reshape(rows, columns)
    if not value.dtype.is_floating_point:
        raise QuantizeError(
            f"scheme {scheme.name}: the given {name} is {value.dtype}; give a float tensor "
            f"({', '.join(spec.tensor.dtypes)}) holding the scales a checkpoint stores"
        )
    require_positive(value, scheme, f"the given {name}", fix)
    if spec.format == "e4m3":
        stored = value.to(torch.float8_e4m3fn)
    else:
        stored = value.to(plan.float_scale_dtype)
        if spec.stored == "reciprocal":
            stored = torch.reciprocal(stored.float()).to(stored.dtype)
    require_storable(value, stored, scheme, f"the given {name}", fix)
    return _oriented(stored, spec.tensor.transposed).reshape(rows, columns)


def _oriented(value: Tensor, transposed: bool) -> Tensor:
    """A scale tensor as given (the stored layout) in the rules' [scale rows, scale columns] order:
    a tensor the scheme stores transposed ([K/g, N], GPTQ's and AWQ's ``scales``) turned back."""
    return value.t().contiguous() if transposed and value.ndim == 2 else value


def _global_scale(plan: WeightPlan, spec: TensorSpec, stored: str, given: object) -> Tensor:
    """A given global scale, checked, as a float32 [1] in its stored convention."""
    value = _tensor(plan, spec.name, given)
    if not value.dtype.is_floating_point or value.numel() != 1:
        raise QuantizeError(
            f"scheme {plan.scheme.name}: {spec.name} must be a one-element float tensor, got "
            f"{value.dtype} of shape {list(value.shape)}"
        )
    fix = f"give the global scale a checkpoint stores ({_convention(stored)}), or leave it out to have it computed"
    require_positive(value, plan.scheme, f"the given {spec.name}", fix)
    as_float32 = value.to(torch.float32)
    require_storable(value, as_float32, plan.scheme, f"the given {spec.name}", fix)
    return as_float32.reshape(1)


def _input(plan: WeightPlan, spec: TensorSpec, given: object, preferred: torch.dtype, fix: str) -> Tensor:
    """A given activation (or pre-quantization) scale, checked, in a declared dtype and shape."""
    value = _tensor(plan, spec.name, given)
    if not value.dtype.is_floating_point:
        raise QuantizeError(f"scheme {plan.scheme.name}: {spec.name} must be a float tensor, got {value.dtype}; {fix}")
    declared = spec.expected_shapes(plan.n, plan.k)
    if declared and value.numel() not in {math.prod(shape) for shape in declared}:
        raise QuantizeError(
            f"scheme {plan.scheme.name}: the given {spec.name} has shape {list(value.shape)}; for a "
            f"{plan.n}x{plan.k} weight it must be {' or '.join(str(list(shape)) for shape in declared)} "
            f"(declared {spec.describe_shapes()})"
        )
    require_positive(value, plan.scheme, f"the given {spec.name}", fix)
    stored = value.to(allowed_dtype(spec, preferred), copy=True)
    require_storable(value, stored, plan.scheme, f"the given {spec.name}", fix)
    return stored.reshape(stored_shape(spec, plan.n, plan.k, stored.numel(), plan.scheme)).contiguous()
