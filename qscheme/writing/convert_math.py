"""Do two schemes share the math? A comparison of their descriptors, with no list of scheme names.

Two schemes "share the math" when a layer stored in one can be stored in the other with the
same element codes, the same block scales and the same zero points: only tensor names, packings,
shapes, dtypes and scale conventions (multiplier or reciprocal) may differ. That is decided from
the descriptors field by field:

- weight: element format, scale granularity, group size or block, scale format, whether there is
  a global scale, zero points and their format;
- a scale whose convention differs can be inverted only if its format is a plain float (an e4m3
  or e8m0 scale has no exact reciprocal): inverting it rounds, which the conversion reports;
- a packing that differs is a relayout of the same codes (unpacked and packed again);
- activation: format, granularity, group size, dynamic or static, scale format, and whether
  there are static scales.

Weight differences change the codes: converting needs a requantization. Activation differences
change how a layer's input is quantized at run time, not its stored weight.
"""

from __future__ import annotations

from dataclasses import dataclass

from qscheme.descriptor import ActivationSpec, Scheme
from qscheme.descriptor.parse import NO_RECIPROCAL


@dataclass(frozen=True)
class SchemeComparison:
    """What converting a layer from ``source`` to ``target`` involves."""

    source: Scheme
    target: Scheme
    weight_differences: tuple[str, ...]  # each "what: source value -> target value"
    activation_differences: tuple[str, ...]
    inverted_roles: tuple[str, ...]  # scale roles stored as a multiplier in one, a reciprocal in the other
    relayout: bool  # the weight's packing differs (the same codes, packed again)

    @property
    def same_math(self) -> bool:
        return not self.weight_differences and not self.activation_differences

    def describe(self) -> str:
        """The differences as one "; "-separated line (empty when the math is the same)."""
        return "; ".join((*self.weight_differences, *self.activation_differences))


def _show(value: object) -> str:
    return "none" if value is None else str(value)


def _differ(out: list[str], what: str, source: object, target: object) -> None:
    if source != target:
        out.append(f"{what}: {_show(source)} -> {_show(target)}")


def _weight_differences(source: Scheme, target: Scheme) -> tuple[list[str], list[str]]:
    out: list[str] = []
    inverted: list[str] = []
    a, b = source.weight, target.weight
    _differ(out, "weight element format", a.format, b.format)
    _differ(out, "weight scale granularity", a.scale.granularity, b.scale.granularity)
    _differ(out, "weight group size", a.scale.group_size, b.scale.group_size)
    _differ(out, "weight scale block", a.scale.block, b.scale.block)
    _differ(out, "weight scale format", a.scale.format, b.scale.format)
    if a.scale.stored != b.scale.stored:
        if a.scale.format in NO_RECIPROCAL or b.scale.format in NO_RECIPROCAL:
            out.append(
                f"weight scale convention: {a.scale.stored} -> {b.scale.stored} "
                f"({a.scale.format} scales have no exact reciprocal)"
            )
        else:
            inverted.append("weight_scale")
    _differ(out, "weight global scale", a.global_scale is not None, b.global_scale is not None)
    if a.global_scale is not None and b.global_scale is not None and a.global_scale.stored != b.global_scale.stored:
        inverted.append("weight_global_scale")
    _differ(
        out,
        "weight zero points",
        a.zero_point.format if a.zero_point else None,
        b.zero_point.format if b.zero_point else None,
    )
    return out, inverted


def _activation_fields(spec: ActivationSpec | None) -> dict[str, object]:
    if spec is None:
        return {"activation quantization": "none (16-bit inputs)"}
    return {
        "activation quantization": "quantized",
        "activation format": spec.format,
        "activation granularity": spec.granularity,
        "activation group size": spec.group_size,
        "activation dynamic": spec.dynamic,
        "activation scale format": spec.scale_format,
        "activation static scale": spec.scale is not None,
        "activation global scale": spec.global_scale is not None,
    }


def _activation_differences(source: Scheme, target: Scheme) -> tuple[list[str], list[str]]:
    out: list[str] = []
    inverted: list[str] = []
    a, b = _activation_fields(source.activation), _activation_fields(target.activation)
    if a["activation quantization"] != b["activation quantization"]:
        _differ(out, "activation quantization", a["activation quantization"], b["activation quantization"])
        return out, inverted
    for key in a:
        _differ(out, key, a[key], b[key])
    act_a, act_b = source.activation, target.activation
    if act_a is not None and act_b is not None and not out:
        if act_a.scale is not None and act_b.scale is not None and act_a.scale.stored != act_b.scale.stored:
            inverted.append("input_scale")
        if (
            act_a.global_scale is not None
            and act_b.global_scale is not None
            and act_a.global_scale.stored != act_b.global_scale.stored
        ):
            inverted.append("input_global_scale")
    return out, inverted


def compare_schemes(source: Scheme, target: Scheme) -> SchemeComparison:
    """How a layer of ``source`` maps onto ``target`` (see the module docstring)."""
    weight, weight_inverted = _weight_differences(source, target)
    activation, activation_inverted = _activation_differences(source, target)
    return SchemeComparison(
        source=source,
        target=target,
        weight_differences=tuple(weight),
        activation_differences=tuple(activation),
        inverted_roles=tuple(weight_inverted + activation_inverted),
        relayout=(source.weight.packing, source.weight.pack_order, source.weight.tensor.transposed)
        != (target.weight.packing, target.weight.pack_order, target.weight.tensor.transposed),
    )
