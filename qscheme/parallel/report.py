"""The ``--tp`` views of ``qscheme resolve`` and ``qscheme inspect``, as text and JSON.

Layers with the same pattern (layer index replaced by ``*``), scheme, style, shapes, kernel and
rejections are one row. Text shows every name from the checkpoint through ``shown`` (escaped
and bounded), as the other checkpoint views do. Pure string building: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from qscheme.checkpoint.inspect import module_pattern
from qscheme.kernels.render import text_table
from qscheme.parallel.plan import LayerShard
from qscheme.parallel.resolve import DegreeVerdict, ShardDecision
from qscheme.parallel.rules import MAX_LISTED_DEGREE
from qscheme.text import group_label, shown

_POWERS = tuple(2**i for i in range(1, 7))


def group_shard_decisions(decisions: Sequence[ShardDecision]) -> list[tuple[str, ShardDecision, int]]:
    """(label, a representative decision, count) of identical decisions, in checkpoint order."""
    groups: dict[tuple[object, ...], list[ShardDecision]] = {}
    for decision in decisions:
        key = (
            module_pattern(decision.name),
            decision.scheme,
            decision.style,
            decision.n,
            decision.k,
            decision.shard_n,
            decision.shard_k,
            decision.kernel,
            decision.fuse_policy,
            tuple(decision.rejections()),
            tuple(p.reason for p in decision.split_problems),
        )
        groups.setdefault(key, []).append(decision)
    return [(group_label(str(key[0]), [d.name for d in same]), same[0], len(same)) for key, same in groups.items()]


def _kernel_cell(decision: ShardDecision) -> str:
    if decision.split_problems:
        return "CANNOT SPLIT"
    return decision.kernel or "NONE"


def render_tp(path: str, tp_size: int, decisions: Sequence[ShardDecision], device: str) -> str:
    """``qscheme resolve PATH --tp N``: one row per group, then what rejects kernels at this degree."""
    lines = [f"checkpoint: {shown(path, limit=1000)}", f"tensor parallel: {tp_size} ranks", f"device: {device}"]
    if not decisions:
        return "\n".join([*lines, "no quantized layers"])
    rows = []
    grouped = group_shard_decisions(decisions)
    for label, decision, count in grouped:
        rows.append(
            (
                shown(label),
                shown(decision.scheme),
                decision.style,
                f"{decision.n}x{decision.k}",
                "-" if decision.split_problems else f"{decision.shard_n}x{decision.shard_k}",
                str(count),
                _kernel_cell(decision),
            )
        )
    header = ("layers", "scheme", "style", "N x K", "shard N x K", "count", "kernel")
    lines.extend(["", text_table(rows, header)])
    good = sum(1 for d in decisions if d.ok)
    lines.extend(["", f"{good} of {len(decisions)} layers split and have a kernel at tp_size {tp_size}"])
    for label, decision, count in grouped:
        details = [str(p) for p in decision.split_problems]
        details += [f"{kernel} rejected ({stage}): {reason}" for kernel, stage, reason in decision.rejections()]
        if not details:
            continue
        lines.extend(["", f"{shown(label)} ({count} layer{'s' if count > 1 else ''}):"])
        lines.extend(f"  {shown(detail, limit=2000)}" for detail in details)
    return "\n".join(lines)


def render_auto(path: str, verdicts: Sequence[DegreeVerdict], device: str) -> str:
    """``--tp auto``: the degrees where every layer splits and has a kernel, and why powers of two fail."""
    working = [v.tp_size for v in verdicts if v.ok]
    lines = [
        f"checkpoint: {shown(path, limit=1000)}",
        f"device: {device}",
        f"tensor-parallel degrees where every layer splits and has a kernel (1..{MAX_LISTED_DEGREE}): "
        + (", ".join(str(t) for t in working) or "none"),
    ]
    failing = [v for v in verdicts if not v.ok and v.tp_size in _POWERS]
    if failing:
        lines.append("")
        for v in failing:
            others = v.failing_layers - 1
            more = f" (and {others} more layer{'s' if others > 1 else ''})" if others else ""
            lines.append(f"tp {v.tp_size}: {shown(v.first_failure, limit=2000)}{more}")
    return "\n".join(lines)


def tp_json(path: str, tp_size: int, decisions: Sequence[ShardDecision], device: str) -> dict[str, object]:
    return {
        "checkpoint": path,
        "tp_size": tp_size,
        "device": device,
        "ok": all(d.ok for d in decisions),
        "layers": [d.as_json() for d in decisions],
    }


def auto_json(path: str, verdicts: Sequence[DegreeVerdict], device: str) -> dict[str, object]:
    return {
        "checkpoint": path,
        "device": device,
        "max_degree": MAX_LISTED_DEGREE,
        "working": [v.tp_size for v in verdicts if v.ok],
        "degrees": [v.as_json() for v in verdicts],
    }


def render_splits(tp_size: int, shards: Sequence[LayerShard]) -> str:
    """``qscheme inspect PATH --tp N``'s extra section: how each kind of layer's tensors split."""
    lines = [f"tensor-parallel splits at tp_size {tp_size}:"]
    seen: set[tuple[object, ...]] = set()
    for shard in shards:
        for member in shard.members:
            key = (module_pattern(member.layer), member.scheme, member.style, member.n, member.k)
            if key in seen:
                continue
            seen.add(key)
            lines.append(
                f"  {shown(module_pattern(member.layer))} ({shown(member.scheme)}, {member.style}, "
                f"{member.n}x{member.k} -> {member.shard_n}x{member.shard_k}):"
            )
            lines.extend(f"    {shown(tensor.describe())}" for tensor in member.tensors.values())
            lines.extend(f"    note: {note}" for note in member.notes)
    return "\n".join(lines)
