"""quantize_weight: one Linear weight -> the tensors a checkpoint of a scheme holds for it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from qscheme.catalog import load_scheme
from qscheme.descriptor import Scheme, TensorSpec
from qscheme.errors import QuantizeError
from qscheme.formats import get_element_format
from qscheme.quantize import compressed_tensors as _compressed_tensors  # noqa: F401  (registers its rules)
from qscheme.quantize import modelopt as _modelopt  # noqa: F401  (registers its rules)
from qscheme.quantize.observe import ScaleLayout
from qscheme.quantize.rounding import round_to_codes, rounding_table
from qscheme.quantize.rules import GivenScales, QuantizationRules, WeightParameters, WeightPlan, get_rules
from qscheme.quantize.slabs import run_slabs, single_threaded_caller, slabs_for
from qscheme.quantize.write import allowed_dtype, input_tensor, pack_codes, packed_layout, packed_rows, write_tensors

WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FIXED_SCALE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def quantize_weight(weight: Tensor, scheme: Scheme | str | Path, **given: Tensor) -> dict[str, Tensor]:
    """The tensors a checkpoint of ``scheme`` holds for one Linear layer with this weight.

    ``weight`` is the [N, K] float32, float16 or bfloat16 weight. The result is keyed by the
    scheme's checkpoint tensor names (``weight_packed``, ``weight_scale``, ...) and holds exactly
    the declared tensors, in the stored dtypes, shapes and scale conventions, computed with the
    arithmetic of the producer named by ``scheme.rules`` (``compressed-tensors`` or ``modelopt``).

    ``given`` supplies scales by their checkpoint names, in the form a checkpoint stores them:
    a weight scale or global scale given is used instead of computing it (e.g. one global scale
    shared by q/k/v); static activation scales (``input_scale``, ``input_global_scale``, ...)
    cannot be derived from a weight, so they appear in the result only when given. A pre-quant
    scale (AWQ) is passed through likewise; the weight must then be the smoothed weight.
    """
    scheme = load_scheme(scheme)
    _check_weight(weight, scheme)
    rules = get_rules(scheme.rules)
    plan = _plan(scheme, weight, rules)
    given_scales, given_inputs = _split_given(plan, rules, given, weight.device)
    with torch.no_grad(), single_threaded_caller():
        padded = plan.layout.pad(weight.detach())
        parameters = rules.parameters(plan, padded, given_scales)
        packed = _quantize_elements(plan, padded, parameters)
        return write_tensors(plan, parameters, packed, given_inputs)


def _check_weight(weight: Tensor, scheme: Scheme) -> None:
    if not isinstance(weight, Tensor):
        raise QuantizeError(f"scheme {scheme.name}: the weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.ndim != 2 or weight.numel() == 0:
        raise QuantizeError(
            f"scheme {scheme.name}: the weight must be a non-empty 2-D [N, K] tensor, got shape {tuple(weight.shape)}"
        )
    if weight.dtype not in WEIGHT_DTYPES:
        raise QuantizeError(
            f"scheme {scheme.name}: the weight is {weight.dtype}; quantize float32, float16 or bfloat16 "
            "weights (convert with weight.float())"
        )


def _plan(scheme: Scheme, weight: Tensor, rules: QuantizationRules) -> WeightPlan:
    n, k = (int(size) for size in weight.shape)
    spec = scheme.weight
    for tensor_spec in _written_specs(scheme):
        if not tensor_spec.expected_shapes(n, k):
            raise QuantizeError(
                f"scheme {scheme.name}: a {n}x{k} weight does not fit tensor {tensor_spec.name!r}, declared "
                f"{tensor_spec.describe_shapes()}; N and K must divide as the shape says"
            )
    element = get_element_format(spec.format)
    if element.kind == "float" and spec.zero_point is not None:
        raise QuantizeError(f"scheme {scheme.name}: zero points need an integer element format, not {element.name!r}")
    scale_format = spec.scale.format
    if scale_format in _FIXED_SCALE_DTYPES:
        float_scale_dtype = _FIXED_SCALE_DTYPES[scale_format]
    else:
        float_scale_dtype = allowed_dtype(spec.scale.tensor, rules.preferred_float_scale_dtype(weight.dtype))
    if spec.scale.stored == "reciprocal" and scale_format in ("e4m3", "e8m0"):
        raise QuantizeError(
            f"scheme {scheme.name}: a reciprocal {scale_format} scale cannot be stored exactly; "
            "declare the scale stored: multiplier"
        )
    activation = scheme.activation
    return WeightPlan(
        scheme=scheme,
        n=n,
        k=k,
        dtype=weight.dtype,
        element=element,
        scale_format=scale_format,
        layout=ScaleLayout.of(spec.scale, n, k),
        has_global_scale=spec.global_scale is not None,
        has_zero_point=spec.zero_point is not None,
        float_scale_dtype=float_scale_dtype,
        activation_format=None if activation is None else activation.format,
    )


def _written_specs(scheme: Scheme) -> list[TensorSpec]:
    weight = scheme.weight
    specs = [weight.tensor, weight.scale.tensor]
    if weight.global_scale is not None:
        specs.append(weight.global_scale.tensor)
    if weight.zero_point is not None:
        specs.append(weight.zero_point.tensor)
    if weight.shape_tensor is not None:
        specs.append(weight.shape_tensor)
    return specs


def _split_given(
    plan: WeightPlan, rules: QuantizationRules, given: Mapping[str, Tensor], device: torch.device
) -> tuple[GivenScales, dict[str, Tensor]]:
    """Given tensors -> (weight scales in their stored form, activation tensors ready to write)."""
    scheme, weight = plan.scheme, plan.scheme.weight
    inputs: dict[str, tuple[TensorSpec, torch.dtype]] = {}
    activation = scheme.activation
    if activation is not None and activation.scale is not None:
        inputs[activation.scale.tensor.name] = (activation.scale.tensor, rules.preferred_float_scale_dtype(plan.dtype))
    if activation is not None and activation.global_scale is not None:
        inputs[activation.global_scale.tensor.name] = (activation.global_scale.tensor, torch.float32)
    if scheme.input_pre_scale is not None:
        inputs[scheme.input_pre_scale.name] = (scheme.input_pre_scale, plan.dtype)
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
    if scale is not None:
        scale = _given_weight_scale(plan, scale).to(device)
    global_scale = None
    if weight.global_scale is not None and weight.global_scale.tensor.name in given:
        global_scale = _given_scalar(plan, weight.global_scale.tensor, given[weight.global_scale.tensor.name]).to(
            device
        )
    written = {
        name: input_tensor(plan, spec, given[name], preferred).to(device)
        for name, (spec, preferred) in inputs.items()
        if name in given
    }
    return GivenScales(scale=scale, global_scale=global_scale), written


def _given_scalar(plan: WeightPlan, spec: TensorSpec, value: Tensor) -> Tensor:
    if not isinstance(value, Tensor) or not value.dtype.is_floating_point or value.numel() != 1:
        raise QuantizeError(
            f"scheme {plan.scheme.name}: {spec.name} must be a one-element float tensor, got "
            f"{tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__}"
        )
    if not bool(torch.isfinite(value).all()) or float(value) <= 0:
        raise QuantizeError(f"scheme {plan.scheme.name}: {spec.name} must be positive and finite, got {float(value)}")
    return value.detach().to(torch.float32).reshape(1)


def _given_weight_scale(plan: WeightPlan, value: Tensor) -> Tensor:
    spec = plan.scheme.weight.scale
    scale_shape = plan.layout.scale_shape
    if not isinstance(value, Tensor) or value.numel() != scale_shape[0] * scale_shape[1]:
        raise QuantizeError(
            f"scheme {plan.scheme.name}: {spec.tensor.name} must hold {scale_shape[0]}x{scale_shape[1]} scales for a "
            f"{plan.n}x{plan.k} weight, got {tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__}"
        )
    value = value.detach().reshape(scale_shape)
    if spec.format == "e8m0":
        if value.dtype != torch.uint8:
            raise QuantizeError(
                f"scheme {plan.scheme.name}: {spec.tensor.name} holds e8m0 bytes (uint8), got {value.dtype}"
            )
        return value
    if spec.format == "e4m3":
        return value.to(torch.float8_e4m3fn)
    value = value.to(plan.float_scale_dtype)
    return torch.reciprocal(value.float()).to(value.dtype) if spec.stored == "reciprocal" else value


def _quantize_elements(plan: WeightPlan, padded: Tensor, parameters: WeightParameters) -> Tensor:
    """Scale, round and pack the weight slab by slab of rows (see qscheme.quantize.slabs)."""
    layout = plan.layout
    table, shift = rounding_table(plan.element.name, parameters.ties, parameters.sign_of_zero)
    table = table.to(padded.device)
    shape, dtype = packed_layout(plan)
    packed = torch.empty(shape, dtype=dtype, device=padded.device)
    unit = math.lcm(layout.tile_rows, 2 if plan.scheme.weight.packing == "int4_n" else 1)

    def work(rows: slice) -> None:
        tile_rows = slice(rows.start, min(layout.padded_n, -(-rows.stop // layout.tile_rows) * layout.tile_rows))
        scale = layout.scale_tiles(parameters.division_scale, tile_rows)
        zero_point = None if parameters.zero_point is None else layout.scale_tiles(parameters.zero_point, tile_rows)
        scaled = parameters.scale_elements(layout.tiles(padded[tile_rows]), scale, zero_point)
        codes = round_to_codes(layout.untile(scaled), table, shift)
        packed[packed_rows(plan, rows)] = pack_codes(plan, codes[: rows.stop - rows.start, : plan.k])

    run_slabs(work, slabs_for(padded.device, plan.n, layout.padded_k, unit), padded.device)
    return packed
