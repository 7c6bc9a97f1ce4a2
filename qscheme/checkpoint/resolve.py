"""Per-layer kernel decisions for a whole checkpoint, from its headers (no weights are read).

``resolve_checkpoint`` plans the checkpoint, builds each layer's resolver Problem (shape,
fused partitions and whether their scales differ, input pre-scale) and resolves it on a real
or simulated device. Layers with identical decisions are grouped for display.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from qscheme.canonical import check_group_index
from qscheme.checkpoint.inspect import module_pattern
from qscheme.checkpoint.plan import FuseSpec, Plan, format_problems, plan_checkpoint
from qscheme.errors import CheckpointError
from qscheme.kernels.plan import MSplit
from qscheme.kernels.problem import Problem, normalize_dtype
from qscheme.kernels.resolver import Resolution
from qscheme.text import group_label


@dataclass(frozen=True)
class LayerDecision:
    """One layer of the checkpoint and its resolution."""

    name: str
    members: tuple[str, ...]
    resolution: Resolution
    fuse_policy: str | None = None

    @property
    def kernel(self) -> str | None:
        return self.resolution.kernel.name if self.resolution.kernel is not None else None

    def as_json(self) -> dict[str, object]:
        return {
            "layer": self.name,
            "members": list(self.members),
            "scheme": self.resolution.scheme.name,
            "problem": self.resolution.problem.as_json(),
            "kernel": self.kernel,
            "fuse_policy": self.fuse_policy,
        }


def stored_scalars(plan: Plan, module: str) -> list[torch.Tensor]:
    """A module's stored per-partition scalars (global / per-tensor weight scale, static input scales)."""
    layout = plan.layouts[module]
    scheme = layout.scheme
    names = []
    if scheme.weight.global_scale is not None:
        names.append(scheme.weight.global_scale.tensor.name)
    elif scheme.weight.scale.granularity == "tensor":
        names.append(scheme.weight.scale.tensor.name)
    activation = scheme.activation
    if activation is not None:
        for spec in (activation.scale, activation.global_scale):
            if spec is not None:
                names.append(spec.tensor.name)
    return [
        plan.files.get(layout.declared[n].name).reshape(-1).to(torch.float32) for n in names if n in layout.declared
    ]


def permuted_inputs(plan: Plan, module: str) -> bool:
    """Whether a module's group index (GPTQ ``g_idx``, a [K] tensor read here) assigns groups out of
    order, so that its layer holds the input channels permuted (``CanonicalWeight.input_permutation``);
    a group index that is no group assignment raises as the load does."""
    layout = plan.layouts[module]
    spec = layout.scheme.weight.scale.group_index
    if spec is None or spec.name not in layout.declared:
        return False
    group_index = plan.files.get(layout.declared[spec.name].name)
    return check_group_index(layout.scheme, group_index, layout.k, module) is not None


def scales_differ(plan: Plan, members: Sequence[str]) -> bool:
    """Whether fused members' stored per-partition scalars differ (a fuse policy must be chosen)."""
    values = [stored_scalars(plan, m) for m in members]
    return any(not torch.equal(values[0][i], other[i]) for other in values[1:] for i in range(len(values[0])))


def resolve_checkpoint(
    path: str | Path,
    *,
    device: str | None = None,
    kernel: str | None = None,
    fuse: FuseSpec | None = None,
    activation_dtype: str = "bfloat16",
    m_split: MSplit | str | int | None = None,
) -> tuple[Plan, list[LayerDecision]]:
    """Every layer's kernel decision on ``device`` (cpu, cuda or a simulated smXY); each
    decision's ``resolution.plan`` gives the kernel per batch size M (``m_split``: the override
    of the declared ranges, as QSCHEME_M_SPLIT takes it; the variable itself when None)."""
    from qscheme.kernels import registry

    plan = plan_checkpoint(path, fuse=fuse)
    if plan.problems:
        raise CheckpointError(f"{plan.path}: {len(plan.problems)} problem(s) found:\n{format_problems(plan.problems)}")
    facts = registry.device_for(device)
    dtype = normalize_dtype(activation_dtype)
    decisions = []
    for name, members in plan.layers():
        layouts = [plan.layouts[m] for m in members]
        scheme = layouts[0].scheme
        differ = len(members) > 1 and scales_differ(plan, members)
        pre_scale = scheme.input_pre_scale is not None and scheme.input_pre_scale.name in layouts[0].declared
        problem = Problem(
            n=sum(layout.n for layout in layouts),
            k=layouts[0].k,
            activation_dtype=dtype,
            partitions=len(members),
            partition_scales_differ=differ,
            input_pre_scale=pre_scale,
            layer=name,
            input_permutation=any(permuted_inputs(plan, member) for member in members),
        )
        resolution = registry.resolve_layer(scheme, problem, facts, kernel, m_split=m_split)
        policy = None
        if len(members) > 1:
            policy = "per_partition" if differ else "shared"
            if differ and (scheme.fused.policy != "per_partition" or resolution.kernel is None):
                policy = scheme.fused.policy if scheme.fused.policy != "per_partition" else scheme.fused.fallback
                if policy != "refuse":
                    shared = Problem(problem.n, problem.k, dtype, len(members), False, pre_scale, name)
                    resolution = registry.resolve_layer(scheme, shared, facts, kernel, m_split=m_split)
        decisions.append(LayerDecision(name, members, resolution, policy))
    return plan, decisions


def group_decisions(decisions: list[LayerDecision]) -> list[tuple[str, LayerDecision, int]]:
    """(module pattern, a representative decision, count) for identical decisions; a MoE block's
    experts show their index range (``experts.{0..7}.gate_proj``, see ``group_label``)."""
    groups: dict[tuple[object, ...], tuple[str, LayerDecision, int]] = {}
    names: dict[tuple[object, ...], list[str]] = {}
    for decision in decisions:
        problem = decision.resolution.problem
        key = (
            module_pattern(decision.name),
            decision.resolution.scheme.name,
            problem.n,
            problem.k,
            problem.partitions,
            problem.partition_scales_differ,
            problem.input_pre_scale,
            decision.kernel,
            decision.fuse_policy,
        )
        found = groups.get(key)
        groups[key] = (key[0], decision, 1) if found is None else (found[0], found[1], found[2] + 1)  # type: ignore[assignment]
        names.setdefault(key, []).append(decision.name)
    return [(group_label(pattern, names[key]), decision, count) for key, (pattern, decision, count) in groups.items()]


def render_checkpoint_resolution(path: str, decisions: list[LayerDecision]) -> str:
    from qscheme.kernels import registry
    from qscheme.kernels.render import text_table

    if not decisions:
        return f"checkpoint: {path}\nno quantized layers"
    first = decisions[0].resolution
    lines = [
        f"checkpoint: {path}",
        f"device: {first.device.describe()}",
        f"activation dtype: {first.problem.activation_dtype}",
    ]
    lines.extend(f"note: {note}" for note in first.device.notes)
    rows = []
    for pattern, decision, count in group_decisions(decisions):
        problem = decision.resolution.problem
        extras = []
        if problem.partitions > 1:
            extras.append(f"{problem.partitions} partitions, fuse policy {decision.fuse_policy}")
        if problem.input_pre_scale:
            extras.append("input pre-scale")
        forced = " (forced)" if decision.resolution.forced and decision.kernel else ""
        rows.append(
            (
                pattern,
                decision.resolution.scheme.name,
                f"{problem.n}x{problem.k}",
                str(count),
                (decision.kernel or "NONE") + forced,
                "; ".join(extras) or "-",
            )
        )
    lines.extend(["", text_table(rows, ("layers", "scheme", "N x K", "count", "kernel", "notes"))])
    resolved = sum(1 for d in decisions if d.kernel is not None)
    lines.append("")
    lines.append(f"{resolved} of {len(decisions)} layers have a kernel")
    unavailable = registry.unavailable_lines()
    if unavailable:
        lines.extend(["", *unavailable])
    failed: dict[tuple[object, ...], list[LayerDecision]] = {}
    for decision in decisions:
        if decision.kernel is None:
            trace = tuple((c.kernel, tuple(f.stage for f in c.failures)) for c in decision.resolution.trace)
            failed.setdefault((decision.resolution.scheme.name, trace), []).append(decision)
    for same in failed.values():
        lines.extend(["", str(registry.no_kernel_error(same[0].resolution))])
        if len(same) > 1:
            lines.append(
                f"(the same kernels reject the other {len(same) - 1} layer(s) of this scheme at the same stages)"
            )
    return "\n".join(lines)


def resolve_command(args: argparse.Namespace) -> int:
    """``qscheme resolve CHECKPOINT``: the body cli/resolve.py dispatches to for a folder."""
    from qscheme.checkpoint.resolve_plans import plan_json, render_plans
    from qscheme.cli.output import print_json

    dtype = getattr(args, "dtype", None) or "bf16"
    batch_sizes: tuple[int, ...] = getattr(args, "batch_sizes", ())  # --m, parsed by qscheme.cli.resolve
    m_split: MSplit | None = getattr(args, "m_split_override", None)  # --m-split (or QSCHEME_M_SPLIT)
    _, decisions = resolve_checkpoint(
        args.target, device=args.device, kernel=args.kernel, activation_dtype=dtype, m_split=m_split
    )
    planned = bool(batch_sizes) or m_split is not None
    if getattr(args, "json", False):
        from qscheme.kernels.registry import unavailable_kernels

        print_json(
            {
                "checkpoint": str(args.target),
                "device": decisions[0].resolution.device.describe() if decisions else None,
                "layers": [d.as_json() for d in decisions],
                "groups": [
                    {"pattern": pattern, "count": count, **decision.as_json()}
                    for pattern, decision, count in group_decisions(decisions)
                ],
                "unavailable_kernels": unavailable_kernels(),
                **(plan_json(decisions, batch_sizes, m_split) if planned else {}),
            }
        )
    else:
        text = render_checkpoint_resolution(str(args.target), decisions)
        if planned:
            text += "\n\n" + render_plans(group_decisions(decisions), decisions, batch_sizes, m_split)
        sys.stdout.write(text + "\n")
    return 0 if all(d.kernel is not None for d in decisions) else 1
