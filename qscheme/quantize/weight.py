"""quantize_weight: one Linear weight -> the tensors a checkpoint of a scheme holds for it."""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import torch
from torch import Tensor

from qscheme.api_checks import require_tensor
from qscheme.canonical import canonicalize
from qscheme.catalog import load_scheme, require_scheme_argument
from qscheme.descriptor import Scheme, TensorSpec
from qscheme.descriptor.parse import NO_RECIPROCAL
from qscheme.errors import QuantizeError
from qscheme.formats import get_element_format
from qscheme.producers import ARITHMETIC_MODULES
from qscheme.quantize.blocks import layer_quantizer, quantize_blocks_for
from qscheme.quantize.checks import META_FIX, require_usable_scales
from qscheme.quantize.given import split_given
from qscheme.quantize.observe import ScaleLayout
from qscheme.quantize.rounding import round_to_codes, rounding_table
from qscheme.quantize.rules import QuantizationRules, WeightParameters, WeightPlan, get_rules
from qscheme.quantize.write import (
    allowed_dtype,
    pack_codes,
    packed_layout,
    packed_row_unit,
    packed_rows,
    write_tensors,
)
from qscheme.slabs import run_slabs, single_threaded_caller, slabs_for

# Each producer's arithmetic module registers its rules when imported; the registry names the
# modules, so that importing it (for the loader) does not import torch.
for _module in ARITHMETIC_MODULES:
    importlib.import_module(_module)

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

    Every scale in the result is finite and > 0. A given weight scale must have a shape the
    descriptor declares and a float dtype (uint8 bytes for e8m0); every given scale must be finite
    and > 0, as given and as stored. A weight whose computed scales or dequantized values would
    overflow (a float16 weight near its limit, values near float32's), and a weight or given scale
    that is not a dense, materialised tensor (sparse, nested, meta), are refused. Errors are
    QuantizeError, naming the tensor, the first bad value or region, and a fix; a scheme that is
    not a Scheme, a str or a path raises UsageError.
    """
    require_scheme_argument(scheme, "quantize_weight")
    scheme = load_scheme(scheme)
    _check_weight(weight, scheme)
    if scheme.weight.blocks is not None:  # a producer's whole-block quantizer (qscheme.quantize.blocks)
        if given:
            raise QuantizeError(
                f"scheme {scheme.name}: packed blocks hold their own scales; given tensors "
                f"({', '.join(sorted(given))}) cannot be used"
            )
        with torch.no_grad():
            return quantize_blocks_for(scheme, weight.detach())
    whole = layer_quantizer(scheme)
    if whole is not None:  # a producer that quantizes whole layers (qscheme.quantize.blocks)
        if given:
            raise QuantizeError(
                f"scheme {scheme.name}: its producer computes every tensor of a layer at once; given tensors "
                f"({', '.join(sorted(given))}) cannot be used"
            )
        with torch.no_grad():
            return whole(scheme, weight.detach())
    rules = get_rules(scheme.rules)
    plan = _plan(scheme, weight, rules)
    given_scales, given_inputs = split_given(plan, rules, given, weight.device)
    with torch.no_grad(), single_threaded_caller():
        padded = plan.layout.pad(weight.detach())
        parameters = rules.parameters(plan, padded, given_scales)
        packed = _quantize_elements(plan, padded, parameters)
        tensors = write_tensors(plan, parameters, packed, given_inputs)
        require_usable_scales(plan, tensors, padded, given_scales)
        if given_inputs:  # given activation scales get the loader's checks, so what is written loads
            canonicalize(scheme, tensors, weight.shape[0], weight.shape[1])
        return tensors


def _check_weight(weight: Tensor, scheme: Scheme) -> None:
    require_tensor(weight, f"scheme {scheme.name}", "the weight", "pass the layer's [N, K] float weight", META_FIX)
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
    if spec.scale.stored == "reciprocal" and scale_format in NO_RECIPROCAL:  # a Scheme built in code
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


def _quantize_elements(plan: WeightPlan, padded: Tensor, parameters: WeightParameters) -> Tensor:
    """Scale, round and pack the weight slab by slab of rows (see qscheme.slabs)."""
    layout = plan.layout
    table, shift = rounding_table(plan.element.name, parameters.ties, parameters.sign_of_zero)
    table = table.to(padded.device)
    shape, dtype = packed_layout(plan)
    packed = torch.empty(shape, dtype=dtype, device=padded.device)
    unit = math.lcm(layout.tile_rows, packed_row_unit(plan))

    def work(rows: slice) -> None:
        tile_rows = slice(rows.start, min(layout.padded_n, -(-rows.stop // layout.tile_rows) * layout.tile_rows))
        scale = layout.scale_tiles(parameters.division_scale, tile_rows)
        zero_point = None if parameters.zero_point is None else layout.scale_tiles(parameters.zero_point, tile_rows)
        scaled = parameters.scale_elements(layout.tiles(padded[tile_rows]), scale, zero_point)
        codes = round_to_codes(layout.untile(scaled), table, shift)
        packed[packed_rows(plan, rows)] = pack_codes(plan, codes[: rows.stop - rows.start, : plan.k])

    run_slabs(work, slabs_for(padded.device, plan.n, layout.padded_k, unit), padded.device)
    return packed
