"""Plain-data views of a Scheme for JSON output and human-readable rendering."""

from __future__ import annotations

from typing import Any

from qscheme.descriptor.blocks import BlockLayout
from qscheme.descriptor.model import Scheme, TensorSpec
from qscheme.descriptor.rules import rule_schemas
from qscheme.descriptor.shapes import format_shape

ROLE_DESCRIPTIONS: dict[str, str] = {
    "weight": "quantized weight elements",
    "weight_scale": "weight scales",
    "weight_global_scale": "weight global scale (one per partition)",
    "weight_zero_point": "weight zero points",
    "weight_shape": "unpacked weight shape [N, K]",
    "weight_symmetric_zero_point": "stored zero points of a symmetric weight (checked, then dropped)",
    "weight_group_index": "group of each input channel (must be k // group_size)",
    "input_pre_scale": "input multiplier applied before the GEMM (AWQ)",
    "input_scale": "static activation scale",
    "input_global_scale": "activation global scale",
}


def tensor_dict(spec: TensorSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "dtype": list(spec.dtypes),
        "shape": [[str(dim) for dim in shape] for shape in spec.shapes],
        "optional": spec.optional,
        **({"transposed": True} if spec.transposed else {}),
    }


def scheme_summary(scheme: Scheme) -> dict[str, Any]:
    """The short record `qscheme schemes --json` lists."""
    return {
        "name": scheme.name,
        "producer": scheme.producer,
        "weight_format": scheme.weight_family,
        "activation_format": scheme.activation_family,
        "group_size": scheme.weight.scale.group_size,
        "description": scheme.description,
        "source": scheme.source,
        "path": scheme.path,
    }


def blocks_dict(layout: BlockLayout) -> dict[str, Any]:
    """A block layout as plain data: sizes, fields, integers (with their planes or pieces), the formula."""
    integers = {}
    for spec in layout.integers:
        entry: dict[str, Any] = {"count": spec.count, "bits": spec.bits, "signed": spec.signed, "offset": spec.offset}
        if spec.planes:
            entry["planes"] = [
                {"field": p.field, "bits": p.bits, "run": p.run, "first_byte": p.first_byte} for p in spec.planes
            ]
        else:
            entry["pieces"] = [[[byte, shift, width] for _, byte, shift, width in value] for value in spec.sources]
        integers[spec.name] = entry
    element = None
    if layout.element is not None:
        element = {"integer": layout.element.integer, "table": layout.element.table, "format": layout.element.format}
    return {
        "elements": layout.elements,
        "bytes": layout.bytes,
        "bits_per_weight": layout.bits_per_weight,
        "fields": [
            {"name": f.name, "offset": f.offset, "bytes": f.size, "format": f.format, "count": f.count}
            for f in layout.fields
        ],
        "integers": integers,
        "element": element,
        "scale": list(layout.scale),
        "minimum": {layout.minimum_sign: list(layout.minimum)} if layout.minimum else None,
        "formula": layout.describe(),
    }


def render_blocks(layout: BlockLayout) -> list[str]:
    """``qscheme show``'s lines for a block layout."""
    lines = [f"  blocks:    {layout.describe()}"]
    for f in layout.fields:
        kind = f"{f.count} x {f.format}" if f.format else "raw"
        lines.append(f"    field    {f.name:<10} bytes [{f.offset}, {f.offset + f.size})  {kind}")
    for spec in layout.integers:
        how = " | ".join(f"{p.field} {p.bits}-bit run {p.run}" for p in spec.planes) if spec.planes else "piece table"
        sign = "signed " if spec.signed else ""
        offset = f", {spec.offset:+d}" if spec.offset else ""
        lines.append(f"    integer  {spec.name:<10} {spec.count} x {sign}{spec.bits}-bit from {how}{offset}")
    return lines


def scheme_dict(scheme: Scheme) -> dict[str, Any]:
    """Everything a descriptor declares, as plain data (`qscheme show --json`)."""
    weight = scheme.weight
    scale = weight.scale
    out: dict[str, Any] = scheme_summary(scheme)
    out["rules"] = scheme.rules
    out["weight"] = {
        "format": weight.format,
        "packing": weight.packing,
        "scale": {
            "granularity": scale.granularity,
            "group_size": scale.group_size,
            "block": list(scale.block) if scale.block else None,
            "format": scale.format,
            "stored": scale.stored,
        },
        "global_scale": {"stored": weight.global_scale.stored} if weight.global_scale else None,
        "zero_point": (
            {"format": weight.zero_point.format, "packing": weight.zero_point.packing} if weight.zero_point else None
        ),
    }
    act = scheme.activation
    if weight.blocks is not None:
        out["weight"]["blocks"] = blocks_dict(weight.blocks)
    out["activation"] = (
        None
        if act is None
        else {
            "format": act.format,
            "granularity": act.granularity,
            "group_size": act.group_size,
            "dynamic": act.dynamic,
            "scale_format": act.scale_format,
            "scale": {"stored": act.scale.stored} if act.scale else None,
            "global_scale": {"stored": act.global_scale.stored} if act.global_scale else None,
        }
    )
    out["tensors"] = {
        role: {**tensor_dict(spec), "stored": scheme.stored_convention(role)}
        for role, spec in scheme.tensor_specs().items()
    }
    out["tolerated"] = list(scheme.tolerated)
    out["fused"] = {"policy": scheme.fused.policy, "fallback": scheme.fused.fallback}
    detect: dict[str, Any] = {}
    for schema in rule_schemas():
        rule = scheme.detect.get(schema.producer)
        if rule is not None:
            detect[schema.producer] = schema.summary(rule)
    out["detect"] = detect
    return out


def render_scheme(scheme: Scheme) -> str:
    """A readable multi-line description of a scheme."""
    weight = scheme.weight
    scale = weight.scale
    lines = [f"{scheme.name}  ({scheme.producer or 'no producer'}; {scheme.source}: {scheme.path or '-'})"]
    if scheme.description:
        lines.append(f"  {scheme.description}")
    granularity: str = scale.granularity
    if scale.group_size:
        granularity += f" of {scale.group_size} along K"
    if scale.block:
        granularity += f" {scale.block[0]}x{scale.block[1]}"
    order = f", slot order {list(weight.pack_order)}" if weight.pack_order else ""
    lines.append(f"weight:      {weight.format} ({scheme.weight_family}), packing {weight.packing}{order}")
    if weight.blocks is not None:
        lines.extend(render_blocks(weight.blocks))
    else:
        lines.append(f"  scale:     {scale.format}, {granularity}, stored as {scale.stored}")
    if weight.global_scale:
        lines.append(f"  global:    one per partition, stored as {weight.global_scale.stored}")
    for zero_point in (weight.zero_point, weight.symmetric_zero_point):
        if zero_point is None:
            continue
        text = f"  zero pt:   {zero_point.format}, packing {zero_point.packing}"
        text += f", slot order {list(zero_point.pack_order)}" if zero_point.pack_order else ""
        sign = "+" if zero_point.offset > 0 else "-"
        text += f", stored as zero {sign} {abs(zero_point.offset)}" if zero_point.offset else ""
        text += (
            f", every one {zero_point.equals} (symmetric: checked, then dropped)"
            if zero_point.equals is not None
            else ""
        )
        lines.append(text)
    act = scheme.activation
    if act is None:
        lines.append("activation:  none (16-bit)")
    else:
        mode = "dynamic" if act.dynamic else "static"
        grouping = act.granularity + (f" of {act.group_size}" if act.group_size else "")
        lines.append(
            f"activation:  {act.format} ({scheme.activation_family}), {mode} per {grouping}, scales {act.scale_format}"
        )
    lines.append("tensors (per linear module):")
    for role, spec in scheme.tensor_specs().items():
        stored = scheme.stored_convention(role)
        shapes = " or ".join(format_shape(shape) for shape in spec.shapes)
        extra = f"  stored as {stored}" if stored else ""
        optional = "  (optional)" if spec.optional else ""
        optional += "  (stored transposed)" if spec.transposed else ""
        lines.append(f"  {spec.name:<22} {'|'.join(spec.dtypes):<32} {shapes:<28} {role}{extra}{optional}")
    if scheme.tolerated:
        lines.append(f"tolerated:   {', '.join(scheme.tolerated)} (dropped when present)")
    lines.append(f"fused:       {scheme.fused.policy}, otherwise {scheme.fused.fallback}")
    for schema in rule_schemas():
        rule = scheme.detect.get(schema.producer)
        if rule is not None:
            lines.append(f"detect:      {schema.render(rule)}")
    return "\n".join(lines)
