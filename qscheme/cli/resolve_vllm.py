"""``qscheme resolve CHECKPOINT --engine vllm [--tp N] [--device D] [--m M,...]``: what the qscheme
vLLM plugin would build for each of vLLM's layers, without vLLM.

vLLM's layers come from the checkpoint's modules grouped as the plugin groups them
(``qscheme.engines.vllm_layers``: fused ``qkv_proj`` / ``gate_up_proj``, the experts of a MoE block
as one fused-MoE layer). For each: the members, qscheme's scheme and the kernel its resolver picks
on the device for the rank's shard (the members' shards by qscheme's TP rules, as the plugin splits
them, or the plugin's refusal with qscheme's message), the per-partition global scales the layer
keeps, the plan over batch sizes when ``--m`` asks, and vLLM's own built-in method for the scheme
(``qscheme.engines.vllm_builtin``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qscheme.checkpoint.plan import Plan, format_problems, plan_checkpoint
from qscheme.checkpoint.resolve import permuted_inputs, scales_differ
from qscheme.cli.output import print_json
from qscheme.engines.vllm_builtin import CPU_ASSUMED, VLLM_VERSION, VllmBuiltin, builtin_for
from qscheme.engines.vllm_layers import (
    EXPERT_FUSED,
    PackedModules,
    VllmLayer,
    expert_of,
    packed_modules_for,
    vllm_layers,
)
from qscheme.errors import CheckpointError, UsageError
from qscheme.kernels import registry
from qscheme.kernels.devices import DeviceFacts
from qscheme.kernels.plan import MSplit
from qscheme.kernels.problem import Problem, normalize_dtype
from qscheme.kernels.render import text_table
from qscheme.kernels.resolver import Resolution
from qscheme.parallel.plan import checked_tp_plan
from qscheme.parallel.rules import ShardError, ShardLayout, Style, shard_layout


@dataclass(frozen=True)
class Part:
    """One group of members resolved together: a linear layer's members, or one projection of
    a fused-MoE layer's experts (each expert's projection is the same problem)."""

    name: str  # the vLLM layer, or "<experts>.*.<projection>"
    members: tuple[str, ...]
    style: Style
    shards: tuple[ShardLayout, ...]
    resolution: Resolution
    global_scales: tuple[tuple[str, tuple[float, ...]], ...] = ()

    def kernel(self) -> str | None:
        return self.resolution.kernel.name if self.resolution.kernel is not None else None


@dataclass(frozen=True)
class LayerExplanation:
    """One vLLM layer: what the plugin builds for it, or why it refuses."""

    layer: VllmLayer
    scheme: str | None
    parts: tuple[Part, ...] = ()
    refusal: str | None = None
    builtin: VllmBuiltin | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return self.refusal is None and all(part.kernel() is not None for part in self.parts)


def _architectures(folder: Path) -> list[str]:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return []
    found = config.get("architectures") if isinstance(config, dict) else None
    return [a for a in found if isinstance(a, str)] if isinstance(found, list) else []


def _kv_heads(folder: Path) -> int | None:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    heads = config.get("num_key_value_heads") if isinstance(config, dict) else None
    return heads if isinstance(heads, int) and heads > 0 else None


def _global_scales(plan: Plan, members: Sequence[str]) -> tuple[tuple[str, tuple[float, ...]], ...]:
    """Each member's stored global (per-partition) weight scale, where the scheme has one."""
    out = []
    for member in members:
        layout = plan.layouts[member]
        spec = layout.scheme.weight.global_scale
        if spec is None or spec.tensor.name not in layout.declared:
            continue
        values = plan.files.get(layout.declared[spec.tensor.name].name).reshape(-1).to(torch.float32)
        out.append((member, tuple(float(v) for v in values.tolist())))
    return tuple(out)


def _resolve_part(
    plan: Plan,
    name: str,
    members: tuple[str, ...],
    style: Style,
    tp: int,
    facts: DeviceFacts,
    kernel: str | None,
    dtype: str,
    m_split: MSplit | None,
    alike: Sequence[tuple[str, ...]] = (),
) -> Part:
    """The members' shards (ShardError where qscheme's rules refuse the split) and the kernel for
    the rank's fused shard, each member keeping its own global scale. ``alike``: the same layer
    of every expert (``members`` is the first), whose global scales are kept too and decide
    whether the partitions' scales differ."""
    layouts = [plan.layouts[m] for m in members]
    scheme = layouts[0].scheme
    shards = tuple(
        shard_layout(
            scheme,
            layout.n,
            layout.k,
            style,
            tp,
            layer=layout.module,
            stored_shapes={short: tuple(info.shape) for short, info in layout.declared.items()},
        )
        for layout in layouts
    )
    groups = list(alike) or [members]
    differ = len(members) > 1 and any(scales_differ(plan, group) for group in groups)
    problem = Problem(
        n=sum(shard.shard_n for shard in shards),
        k=shards[0].shard_k,
        activation_dtype=dtype,
        partitions=len(members),
        partition_scales_differ=differ,
        input_pre_scale=scheme.input_pre_scale is not None and scheme.input_pre_scale.name in layouts[0].declared,
        layer=name,
        input_permutation=any(permuted_inputs(plan, member) for member in members),
    )
    resolution = registry.resolve_layer(scheme, problem, facts, kernel, m_split=m_split)
    kept = _global_scales(plan, [member for group in groups for member in group])
    return Part(name, members, style, shards, resolution, kept)


def _moe_parts(layer: VllmLayer) -> list[tuple[str, list[tuple[str, ...]]]]:
    """A fused-MoE layer's per-expert layers as the plugin builds them: (``experts.*.gate_up_proj``,
    each expert's (gate_proj, up_proj)) and (``experts.*.down_proj``, each expert's (down_proj,)),
    experts in index order (``EXPERT_FUSED``; a projection stored fused stays as stored)."""
    by_expert: dict[int, dict[str, str]] = {}
    for member in layer.members:
        found = expert_of(member)
        if found is not None:
            by_expert.setdefault(found[1], {})[found[2]] = member
    groups: dict[str, list[tuple[str, ...]]] = {}
    for _, projections in sorted(by_expert.items()):
        taken: set[str] = set()
        for fused, parts in EXPERT_FUSED.items():
            if all(part in projections for part in parts):
                groups.setdefault(fused, []).append(tuple(projections[part] for part in parts))
                taken.update(parts)
        for projection, member in projections.items():
            if projection not in taken:
                groups.setdefault(projection, []).append((member,))
    return [(f"{layer.name}.*.{name}", experts) for name, experts in groups.items()]


def explain_layer(
    plan: Plan,
    layer: VllmLayer,
    tp: int,
    facts: DeviceFacts,
    kernel: str | None,
    dtype: str,
    m_split: MSplit | None,
    kv_heads: int | None,
) -> LayerExplanation:
    tp_plan = checked_tp_plan(None)
    present = [member for member in layer.members if member in plan.layouts]
    absent = [member for member in layer.members if member not in plan.layouts]
    schemes = sorted({plan.layouts[m].scheme.name for m in present})
    scheme = schemes[0] if len(schemes) == 1 else None
    builtin = builtin_for(scheme) if scheme is not None else None
    if absent:
        return LayerExplanation(
            layer,
            scheme,
            refusal=f"{layer.name}: vLLM fuses {', '.join(layer.members)}, and {', '.join(absent)} is not quantized "
            f"in the checkpoint while the others are; the plugin refuses it: quantize all of them or none",
            builtin=builtin,
        )
    if len(schemes) > 1:
        return LayerExplanation(
            layer,
            None,
            refusal=f"{layer.name}: vLLM fuses {', '.join(layer.members)}, which use different schemes "
            f"({', '.join(schemes)}); one fused layer runs one scheme: the plugin refuses it",
        )
    if layer.short_name == "qkv_proj" and kv_heads is not None and tp > kv_heads:
        return LayerExplanation(
            layer,
            scheme,
            refusal=f"{layer.name}: --tp {tp} exceeds the {kv_heads} KV heads; vLLM then replicates KV heads, which "
            "the plugin does not yet: serve with a tensor_parallel_size that divides every member",
            builtin=builtin,
        )
    try:
        if layer.kind == "fused_moe":
            parts = tuple(
                _resolve_part(
                    plan,
                    name,
                    experts[0],
                    tp_plan.fused_style(name, experts[0]),
                    tp,
                    facts,
                    kernel,
                    dtype,
                    m_split,
                    experts,
                )
                for name, experts in _moe_parts(layer)
            )
            scales = _global_scales(plan, layer.members)
            notes: tuple[str, ...] = (f"{len(layer.members)} expert projections",)
            if scales:
                notes += (f"{len(scales)} global scales, one per expert projection, each kept",)
            return LayerExplanation(layer, scheme, parts, builtin=builtin, notes=notes)
        style = tp_plan.fused_style(layer.name, layer.members)
        part = _resolve_part(plan, layer.name, layer.members, style, tp, facts, kernel, dtype, m_split)
    except ShardError as exc:
        return LayerExplanation(layer, scheme, refusal=str(exc), builtin=builtin)
    return LayerExplanation(layer, scheme, (part,), builtin=builtin)


def explain_checkpoint(
    path: str | Path,
    *,
    tp: int = 1,
    device: str | DeviceFacts | None = None,
    kernel: str | None = None,
    activation_dtype: str = "bfloat16",
    m_split: MSplit | None = None,
    packed_modules: PackedModules | None = None,
) -> tuple[DeviceFacts, PackedModules, list[LayerExplanation]]:
    """Every vLLM layer of the checkpoint on ``device`` at tensor-parallel degree ``tp``."""
    plan = plan_checkpoint(path)
    if plan.problems:
        raise CheckpointError(f"{plan.path}: {len(plan.problems)} problem(s) found:\n{format_problems(plan.problems)}")
    folder = Path(path)
    mapping = packed_modules if packed_modules is not None else packed_modules_for(_architectures(folder))
    facts = registry.device_for(device)
    dtype = normalize_dtype(activation_dtype)
    kv_heads = _kv_heads(folder)
    layers = vllm_layers(plan.layouts, mapping)
    return facts, mapping, [explain_layer(plan, layer, tp, facts, kernel, dtype, m_split, kv_heads) for layer in layers]


def parse_engine_tp(text: str | None) -> int:
    if text is None:
        return 1
    value = text.strip()
    if not value.isdigit() or not 1 <= int(value) <= 1024:
        raise UsageError(
            f"--tp {text!r} with --engine vllm: expected vLLM's tensor_parallel_size, a degree in 1..1024 "
            "('auto' is for qscheme's own loader: drop --engine to list the degrees that split)"
        )
    return int(value)


def _shard_text(part: Part) -> str:
    if part.shards[0].tp_size == 1:
        return "-"
    n = sum(s.shard_n for s in part.shards)
    return f"{n}x{part.shards[0].shard_k} ({part.style})"


def _scales_text(part: Part) -> str:
    """How many per-partition global scales the layer keeps, and whether they differ (values: --json)."""
    if not part.global_scales:
        return "-"
    count = len(part.global_scales)
    if count == 1:
        return "1 kept"
    differ = len({values for _, values in part.global_scales}) > 1
    each = ""
    if count > len(part.members):
        each = "one per expert and partition, " if len(part.members) > 1 else "one per expert, "
    return f"{count} kept, {each}{'different' if differ else 'equal'}"


def _group(explanations: Sequence[LayerExplanation]) -> list[tuple[str, LayerExplanation, int]]:
    """Identical layers of different decoder layers as one row (``model.layers.*.self_attn.qkv_proj``)."""
    from qscheme.checkpoint.inspect import module_pattern

    groups: dict[tuple[object, ...], list[LayerExplanation]] = {}
    for item in explanations:
        key = (
            module_pattern(item.layer.name),
            item.scheme,
            item.refusal is None,
            tuple(
                (p.resolution.problem.n, p.resolution.problem.k, p.kernel(), _shard_text(p), _scales_text(p))
                for p in item.parts
            ),
        )
        groups.setdefault(key, []).append(item)
    return [(str(key[0]), found[0], len(found)) for key, found in groups.items()]


def render(
    path: str,
    facts: DeviceFacts,
    tp: int,
    mapping: PackedModules,
    explanations: Sequence[LayerExplanation],
    batch_sizes: Sequence[int],
) -> str:
    fused = ", ".join(f"{name} <- {'/'.join(members)}" for name, members in mapping.items()) or "none"
    lines = [
        f"checkpoint: {path}",
        f'engine: vLLM {VLLM_VERSION} with the qscheme plugin (quantization="qscheme"), tensor_parallel_size={tp}',
        f"device: {facts.describe()}",
        f"vLLM fuses: {fused}",
    ]
    rows: list[tuple[str, ...]] = []
    for pattern, item, count in _group(explanations):
        if item.refusal is not None or not item.parts:
            rows.append((pattern, item.layer.kind, item.scheme or "-", "-", "-", str(count), "REFUSED", "-"))
            continue
        for index, part in enumerate(item.parts):
            name = pattern if item.layer.kind == "linear" else f"{pattern}.*.{part.name.rpartition('.')[2]}"
            rows.append(
                (
                    name,
                    item.layer.kind if index == 0 else "",
                    item.scheme or "-",
                    f"{sum(s.n for s in part.shards)}x{part.shards[0].k}",
                    _shard_text(part),
                    str(count) if index == 0 else "",
                    part.kernel() or "NONE",
                    _scales_text(part),
                )
            )
    header = ("vLLM layer", "kind", "scheme", "N x K", "rank shard", "count", "qscheme kernel", "global scales")
    lines.extend(["", text_table(rows, header)])
    refused = [(p, item) for p, item, _ in _group(explanations) if item.refusal is not None]
    if refused:
        lines.extend(["", "refused (the plugin raises these, naming the layer):"])
        lines.extend(f"  {item.refusal}" for _, item in refused)
    if batch_sizes:
        lines.extend(["", f"plans over M (--m {','.join(str(m) for m in batch_sizes)}):"])
        for pattern, item, _ in _group(explanations):
            for part in item.parts:
                plan = part.resolution.plan
                if plan.entries:
                    shown = "  ".join(f"M={m}: {plan.kernel_for(m).name}" for m in batch_sizes)
                    label = pattern if item.layer.kind == "linear" else part.name
                    lines.append(f"  {label}: {plan.describe()}  ({shown})")
    builtins: dict[str, str] = {}
    for item in explanations:
        if item.scheme is not None and item.scheme not in builtins:
            entry = item.builtin
            builtins[item.scheme] = (
                entry.describe(facts.type) if entry is not None else "not in qscheme's table of vLLM's methods"
            )
    if builtins:
        lines.extend(["", f'vLLM {VLLM_VERSION}\'s own method for the linear layers (without quantization="qscheme"):'])
        if facts.type == "cpu":
            lines.append(f"  (its CPU kernel as vLLM chooses it on {CPU_ASSUMED})")
        lines.extend(f"  {scheme}: {text}" for scheme, text in builtins.items())
    ok = sum(1 for item in explanations if item.ok)
    lines.extend(["", f"{ok} of {len(explanations)} vLLM layers have a qscheme kernel"])
    return "\n".join(lines)


def as_json(
    path: str,
    facts: DeviceFacts,
    tp: int,
    mapping: PackedModules,
    explanations: Sequence[LayerExplanation],
    batch_sizes: Sequence[int],
) -> dict[str, object]:
    def part_json(part: Part) -> dict[str, object]:
        plan = part.resolution.plan
        return {
            "name": part.name,
            "members": list(part.members),
            "style": part.style,
            "problem": part.resolution.problem.as_json(),
            "kernel": part.kernel(),
            "shards": [
                {"member": s.layer, "n": s.n, "k": s.k, "shard_n": s.shard_n, "shard_k": s.shard_k} for s in part.shards
            ],
            "global_scales": {member: list(values) for member, values in part.global_scales},
            "plan": plan.as_json(),
            "batch_sizes": [{"m": m, "kernel": plan.kernel_for(m).name} for m in batch_sizes if plan.entries],
        }

    return {
        "checkpoint": path,
        "engine": "vllm",
        "vllm_version": VLLM_VERSION,
        "tensor_parallel_size": tp,
        "device": facts.as_json(),
        "packed_modules_mapping": {name: list(members) for name, members in mapping.items()},
        "layers": [
            {
                "layer": item.layer.name,
                "kind": item.layer.kind,
                "members": list(item.layer.members),
                "scheme": item.scheme,
                "refusal": item.refusal,
                "parts": [part_json(part) for part in item.parts],
                "notes": list(item.notes),
                "vllm_builtin": item.builtin.as_json() if item.builtin is not None else None,
            }
            for item in explanations
        ],
    }


def run_vllm(args: argparse.Namespace, gguf: bool) -> int:
    """``qscheme resolve PATH --engine vllm``: exit 0 when every vLLM layer has a kernel, 1 otherwise."""
    if gguf:
        raise UsageError(
            f"--engine vllm: {args.target} is a GGUF file; the qscheme vLLM plugin reads a checkpoint folder "
            "(config.json and safetensors); drop --engine to resolve the GGUF file"
        )
    tp = parse_engine_tp(args.tp)
    facts, mapping, explanations = explain_checkpoint(
        args.target,
        tp=tp,
        device=args.device,
        kernel=args.kernel,
        activation_dtype=getattr(args, "dtype", None) or "bf16",
        m_split=getattr(args, "m_split_override", None),
    )
    batch_sizes: tuple[int, ...] = getattr(args, "batch_sizes", ())
    if args.json:
        print_json(as_json(str(args.target), facts, tp, mapping, explanations, batch_sizes))
    else:
        sys.stdout.write(render(str(args.target), facts, tp, mapping, explanations, batch_sizes) + "\n")
    return 0 if all(item.ok for item in explanations) else 1
