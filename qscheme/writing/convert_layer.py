"""One layer's checkpoint tensors in one scheme -> the same layer's tensors in another.

Pure per-layer work, no files. The two descriptors say everything (``convert_math``): each
source tensor is found by its role (weight, weight_scale, weight_global_scale, input_scale, ...)
and written under the target's name for that role,

- with the codes untouched: the same tensor when the packing is the same, else the same codes
  unpacked and packed again as the target packs them;
- with scales whose convention differs (multiplier vs reciprocal) inverted in float32 and stored
  in float32 where the target allows it (else its first declared dtype); other scales keep their
  dtype where the target allows it, else they are cast, and a cast that would change a value is
  a change of math;
- reshaped to the first shape the target declares that holds the values ([] vs [1]);
- with a ``weight_shape`` tensor made where the target declares one.

Inverting a float32 scale rounds: ``fl(1/fl(1/x))`` is not always ``x``. Each result records the
source tensor every inverted scale came from (``originals``), so that converting back can give
the original tensor bit for bit (``restore``): a recorded original is used only when inverting
it gives exactly the tensor being converted back.

Every result carries the largest deviation, in float32 ulps and in absolute value, between the
source's and the target's dequantized weights. A conversion that would change codes is refused
(RequantizationRefusedError) unless ``allow_requantize``: the source is then dequantized and
quantized again with the target's arithmetic (``quantize_weight``), and the deviation is the
error that introduced.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from torch import Tensor

from qscheme.canonical import CanonicalWeight, canonicalize, dequantize, layer_shape, oriented_tensors
from qscheme.descriptor import Scheme, TensorSpec
from qscheme.errors import QuantizeError, UsageError
from qscheme.formats import get_element_format, pack_fp4_k, pack_int4_n, pack_int32_k, pack_int32_n, unpack_fp4_k
from qscheme.quantize.write import dtype_name, dtype_of
from qscheme.writing.convert_deviation import Deviation, compare_dequantized, weight_deviation
from qscheme.writing.convert_math import SchemeComparison, compare_schemes
from qscheme.writing.error_report import compare_weights

Action = Literal["converted", "requantized"]


class RequantizationRefusedError(UsageError):
    """Converting a layer would change its codes (or how its input is quantized); pass
    ``allow_requantize=True`` (``--allow-requantize``) to accept that and get the error reported."""


class UnconvertibleLayerError(UsageError):
    """The target scheme needs something the source layer does not hold (e.g. a calibrated
    static activation scale), so no conversion, not even a requantization, can produce it."""


@dataclass(frozen=True)
class LayerConversion:
    """One converted layer: its target tensors (by short name) and what the conversion did."""

    module: str
    source_scheme: str
    target_scheme: str
    action: Action
    tensors: dict[str, Tensor]
    max_ulps: int
    max_abs_error: float
    inverted: tuple[str, ...] = ()  # target short names of scales stored as the other convention
    originals: dict[str, Tensor] = field(default_factory=dict)  # target short name -> source tensor inverted
    restored: tuple[str, ...] = ()  # target short names given back from a recorded original
    notes: tuple[str, ...] = ()
    # with defer_deviation: the deviation, still to compute (max_ulps / max_abs_error are 0 until then)
    pending: Callable[[], Deviation] | None = None
    # a requantized layer's ||W - Q(W)||_F / ||W||_F against the source's dequantized weight
    relative_error: float | None = None

    def with_deviation(self, deviation: Deviation) -> LayerConversion:
        """This result with its deviation filled in (see ``pending``)."""
        return replace(self, max_ulps=deviation.max_ulps, max_abs_error=deviation.max_abs_error, pending=None)


# --- lookups -----------------------------------------------------------------------------------


def _roles_by_name(scheme: Scheme) -> dict[str, str]:
    return {spec.name: role for role, spec in scheme.tensor_specs().items()}


def _dtype_name(value: Tensor) -> str:
    return dtype_name(value.dtype)


def _stored(value: Tensor, spec: TensorSpec, n: int, k: int, scheme: Scheme, module: str) -> Tensor:
    """``value`` (in qscheme's orientation) as ``spec`` stores it: reshaped, and transposed where the
    target declares the tensor ``transposed``."""
    shape = _target_shape(spec, n, k, value.numel(), scheme, module)
    if spec.transposed:
        return value.reshape(shape[::-1]).T.contiguous()
    return value.reshape(shape)


def _target_shape(spec: TensorSpec, n: int, k: int, numel: int, scheme: Scheme, module: str) -> tuple[int, ...]:
    for shape in spec.expected_shapes(n, k):
        count = 1
        for size in shape:
            count *= size
        if count == numel:
            return shape
    raise UnconvertibleLayerError(
        f"layer {module}: {scheme.name} declares {spec.name!r} as {spec.describe_shapes()}, which for "
        f"N={n}, K={k} cannot hold the {numel} values of the source tensor; check the target scheme's shapes"
    )


def _invert(value: Tensor, spec: TensorSpec) -> Tensor:
    inverse = torch.reciprocal(value.to(torch.float32))
    dtype = torch.float32 if "float32" in spec.dtypes else dtype_of(spec.dtypes[0])
    return inverse.to(dtype)


def _identical(a: Tensor, b: Tensor) -> bool:
    """The same dtype and the same values bit for bit, whatever the shapes ([] and [1] alike)."""
    if a.dtype != b.dtype or a.numel() != b.numel():
        return False
    return bool(torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


# --- the weight's codes ------------------------------------------------------------------------


def _relayout_weight(canonical: CanonicalWeight, target: Scheme, n: int, k: int) -> Tensor:
    """The source's canonical codes packed as the target packs them."""
    element = get_element_format(target.weight.format)
    packing = target.weight.packing
    codes = canonical.codes
    if element.bits == 4:
        nibbles = unpack_fp4_k(codes.view(torch.uint8), k)
        if packing == "nibbles_k":
            return pack_fp4_k(nibbles)
        values = nibbles.to(torch.int16)
        values = ((values ^ 8) - 8) if element.signed else values - 8  # pack_int32_k takes value - offset
        if packing == "int32_k":
            return pack_int32_k(values.to(torch.int8), 4, target.weight.pack_order)
        if packing == "int32_n":
            return pack_int32_n(values.to(torch.int8), 4, target.weight.pack_order)
        if packing == "int4_n" and element.signed:
            return pack_int4_n(values.to(torch.int8))
    elif packing == "none":
        return codes.view(element.storage_dtype)
    elif packing in ("int32_k", "int32_n"):
        values = codes.view(torch.int8) if element.signed else (codes.to(torch.int16) - (1 << (element.bits - 1)))
        pack = pack_int32_k if packing == "int32_k" else pack_int32_n
        return pack(values.to(torch.int8), element.bits, target.weight.pack_order)
    raise UnconvertibleLayerError(
        f"{target.name}: cannot pack {element.name} codes as {packing!r}; convert to a scheme with another packing"
    )


# --- conversion --------------------------------------------------------------------------------


def _refusal(module: str, comparison: SchemeComparison, extra: list[str]) -> RequantizationRefusedError:
    differences = [*comparison.weight_differences, *comparison.activation_differences, *extra]
    changes = "changes the codes" if comparison.weight_differences or extra else "changes how inputs are quantized"
    return RequantizationRefusedError(
        f"layer {module}: converting {comparison.source.name} to {comparison.target.name} {changes} "
        f"({'; '.join(differences)}); only schemes that share the math convert exactly. Pass "
        "allow_requantize=True (--allow-requantize) to dequantize and quantize again in the target scheme, "
        "with the error reported per layer, or choose a target with the same math"
    )


def _missing_inputs(module: str, comparison: SchemeComparison, present: Collection[str]) -> None:
    """Static activation scales the target needs must come from the source, under the same role."""
    source, target = comparison.source, comparison.target
    source_roles = {role: spec.name for role, spec in source.tensor_specs().items()}
    for role, spec in target.tensor_specs().items():
        if role not in ("input_scale", "input_global_scale") or spec.optional:
            continue
        found = source_roles.get(role)
        if found is None or found not in present or comparison.activation_differences:
            raise UnconvertibleLayerError(
                f"layer {module}: {target.name} needs a calibrated static activation scale {spec.name!r}, which "
                f"{source.name} does not hold ({'absent' if found is None else f'{found!r} has another meaning'}); "
                "no conversion can make one. Quantize the unquantized model with `qscheme quantize --calibration` "
                "instead, or choose a target without static activation scales"
            )


def _pre_scale_difference(comparison: SchemeComparison, present: Collection[str]) -> list[str]:
    pre_scale = comparison.source.input_pre_scale
    if pre_scale is not None and pre_scale.name in present and comparison.target.input_pre_scale is None:
        return [f"input pre-scale {pre_scale.name!r}: present -> not declared by {comparison.target.name}"]
    return []


def check_conversion(
    module: str, comparison: SchemeComparison, present: Collection[str], *, allow_requantize: bool
) -> None:
    """Everything ``convert_layer`` would refuse that the tensor names alone show (``present``: the
    layer's source short names): requantizations without ``allow_requantize``, and targets needing
    static activation scales the source lacks. Lets a whole checkpoint be checked before writing."""
    _missing_inputs(module, comparison, present)
    extra = _pre_scale_difference(comparison, present)
    if comparison.weight_differences or extra or comparison.activation_differences:
        if not allow_requantize:
            raise _refusal(module, comparison, extra)


def convert_layer(
    module: str,
    source: Scheme,
    target: Scheme,
    tensors: Mapping[str, Tensor],
    *,
    allow_requantize: bool = False,
    restore: Mapping[str, Tensor] | None = None,
    defer_deviation: bool = False,
) -> LayerConversion:
    """The target tensors of one layer (keyed by the target's short names) and a report.

    ``tensors`` are the layer's source tensors by short name (``weight``, ``weight_scale``, ...),
    as the checkpoint loader reads them (a ``bias`` is not part of them). ``restore`` maps
    target short names to original tensors recorded by an earlier conversion (see the module
    docstring). Raises RequantizationRefusedError when the codes would change and
    ``allow_requantize`` is false, UnconvertibleLayerError when the target needs data the source
    does not have, QuantizeError when the source tensors do not fit their scheme.
    ``defer_deviation`` leaves an exact conversion's deviation report to the caller: the result's
    ``pending`` computes it (e.g. in a worker thread while the tensors are written).
    """
    comparison = compare_schemes(source, target)
    check_conversion(module, comparison, tensors, allow_requantize=allow_requantize)
    source_roles = _roles_by_name(source)
    unknown = sorted(name for name in tensors if name not in source_roles and name not in source.tolerated)
    if unknown:
        raise QuantizeError(
            f"layer {module}: {', '.join(map(repr, unknown))} is no tensor of {source.name} "
            f"(it declares {', '.join(sorted(source_roles))}; tolerated: {', '.join(source.tolerated) or 'none'})"
        )
    n, k = layer_shape(source, tensors)
    declared = {name: value for name, value in tensors.items() if name in source_roles}
    original = canonicalize(source, declared, n, k, layer=module)
    extra = _pre_scale_difference(comparison, tensors)
    if comparison.weight_differences or extra:
        return _requantize(module, comparison, original, tensors, extra)
    dropped = sorted(set(tensors) - set(declared))
    return _convert(module, comparison, original, declared, n, k, restore or {}, dropped, defer_deviation)


def _convert(
    module: str,
    comparison: SchemeComparison,
    original: CanonicalWeight,
    tensors: Mapping[str, Tensor],
    n: int,
    k: int,
    restore: Mapping[str, Tensor],
    dropped: list[str],
    defer_deviation: bool = False,
) -> LayerConversion:
    source, target = comparison.source, comparison.target
    if original.input_permutation is not None and target.weight.scale.group_index is None:
        raise UnconvertibleLayerError(
            f"layer {module}: its {source.name} group index assigns groups out of order (GPTQ act-order), so its "
            f"codes hold the input channels permuted; {target.name} stores groups of consecutive columns and no "
            "permutation, so the codes cannot be copied: convert with --allow-requantize (the weight is quantized "
            "again in the input's order, the error reported), or re-quantize the model without act-order"
        )
    source_specs, target_specs = source.tensor_specs(), target.tensor_specs()
    tensors = oriented_tensors(source, tensors)  # transposed ones turned to qscheme's orientation
    out: dict[str, Tensor] = {}
    inverted: list[str] = []
    originals: dict[str, Tensor] = {}
    restored: list[str] = []
    notes: list[str] = []
    for role, target_spec in target_specs.items():
        name = target_spec.name
        if role == "weight":
            value = tensors[source.weight.tensor.name]
            if comparison.relayout:
                value = _relayout_weight(original, target, n, k)
            out[name] = _stored(value, target_spec, n, k, target, module)
            continue
        if role == "weight_shape":
            dtype = dtype_of(target_spec.dtypes[0])
            out[name] = torch.tensor([n, k], dtype=dtype).reshape(_target_shape(target_spec, n, k, 2, target, module))
            continue
        source_spec = source_specs.get(role)
        if source_spec is None or source_spec.name not in tensors:
            if target_spec.optional or role.startswith("input_"):
                continue  # an optional tensor, or an activation scale of a scheme quantizing inputs dynamically
            raise UnconvertibleLayerError(
                f"layer {module}: {target.name} needs {name!r} ({role}), which the {source.name} layer does not hold"
            )
        value = tensors[source_spec.name]
        if role == "weight_zero_point" and source.weight.zero_point != target.weight.zero_point:
            value = _relayout_zero_point(original, target)
        elif role in comparison.inverted_roles:
            kept = restore.get(name)
            if kept is not None and _identical(_invert(kept, source_spec), value) and _fits(kept, target_spec, n, k):
                out[name] = kept
                restored.append(name)
                inverted.append(name)
                continue
            originals[name] = value
            inverted.append(name)
            value = _invert(value, target_spec)
        else:
            value = _cast(module, value, target_spec, target)
        out[name] = _stored(value, target_spec, n, k, target, module)
    notes.extend(f"dropped {name!r}, which {source.name} tolerates and {target.name} does not use" for name in dropped)
    if comparison.activation_differences:
        notes.append(f"activation quantization changes: {'; '.join(comparison.activation_differences)}")

    def measure() -> Deviation:
        # the target is built from the checked source tensors: its finiteness follows (check_finite=False)
        converted = canonicalize(target, out, n, k, layer=module, check_finite=False)
        if not _same_codes(converted.codes, original.codes):
            raise QuantizeError(f"layer {module}: the codes changed in conversion to {target.name}; this is a bug")
        return weight_deviation(original, converted)

    deviation = None if defer_deviation else measure()
    return LayerConversion(
        module=module,
        source_scheme=source.name,
        target_scheme=target.name,
        action="converted",
        tensors=out,
        max_ulps=deviation.max_ulps if deviation else 0,
        max_abs_error=deviation.max_abs_error if deviation else 0.0,
        inverted=tuple(inverted),
        originals=originals,
        restored=tuple(restored),
        notes=tuple(notes),
        pending=None if deviation else measure,
    )


def _same_codes(a: Tensor, b: Tensor) -> bool:
    a, b = a.view(torch.uint8), b.view(torch.uint8)
    if a.shape == b.shape and a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True  # the very same memory
    return bool(torch.equal(a, b))


def _fits(value: Tensor, spec: TensorSpec, n: int, k: int) -> bool:
    return _dtype_name(value) in spec.dtypes and tuple(value.shape) in spec.expected_shapes(n, k)


def _cast(module: str, value: Tensor, spec: TensorSpec, target: Scheme) -> Tensor:
    """``value`` in a dtype ``spec`` allows: its own where allowed, else a cast that must be exact."""
    if _dtype_name(value) in spec.dtypes:
        return value
    wanted = dtype_of(spec.dtypes[0])
    cast = value.to(wanted)
    if not _identical(cast.to(value.dtype), value):
        raise RequantizationRefusedError(
            f"layer {module}: {target.name} stores {spec.name!r} as {', '.join(spec.dtypes)}, which cannot hold the "
            f"source's {_dtype_name(value)} values exactly; pass allow_requantize=True (--allow-requantize) to "
            "requantize, or declare the dtype in the target scheme"
        )
    return cast


def _relayout_zero_point(original: CanonicalWeight, target: Scheme) -> Tensor:
    from qscheme.canonical import stored_zero_points

    assert original.zero_point is not None
    return stored_zero_points(target, original.zero_point)


def _requantize(
    module: str,
    comparison: SchemeComparison,
    original: CanonicalWeight,
    tensors: Mapping[str, Tensor],
    extra: list[str],
) -> LayerConversion:
    from qscheme.quantize import quantize_weight

    source, target = comparison.source, comparison.target
    weight = dequantize(original)
    if original.input_pre_scale is not None and target.input_pre_scale is None:
        # (x * s) @ W.T == x @ (W * s).T: the pre-scale is folded into the weight the target quantizes
        weight = weight * original.input_pre_scale.to(torch.float32).reshape(1, -1)
    given: dict[str, Tensor] = {}
    if not comparison.activation_differences:
        source_specs = source.tensor_specs()
        for role, spec in target.tensor_specs().items():
            found = source_specs.get(role)
            if role.startswith("input_") and found is not None and found.name in tensors:
                value = tensors[found.name]
                given[spec.name] = _invert(value, spec) if role in comparison.inverted_roles else value
    try:
        out = quantize_weight(weight, target, **given)
    except QuantizeError as error:
        raise QuantizeError(f"layer {module}: requantizing {source.name} as {target.name} failed: {error}") from error
    converted = canonicalize(target, out, original.n, original.k, layer=module)
    requantized = dequantize(converted)
    deviation: Deviation = compare_dequantized(weight, requantized)
    measured = compare_weights(weight, requantized)
    differences = [*comparison.weight_differences, *comparison.activation_differences, *extra]
    return LayerConversion(
        module=module,
        source_scheme=source.name,
        target_scheme=target.name,
        action="requantized",
        tensors=out,
        max_ulps=deviation.max_ulps,
        max_abs_error=deviation.max_abs_error,
        relative_error=measured.relative,
        notes=(f"requantized: {'; '.join(differences)}",),
    )


__all__ = [
    "LayerConversion",
    "RequantizationRefusedError",
    "UnconvertibleLayerError",
    "check_conversion",
    "convert_layer",
]
