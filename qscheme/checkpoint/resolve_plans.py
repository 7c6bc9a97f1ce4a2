"""Per-layer kernel plans of a checkpoint: ``qscheme resolve CHECKPOINT --m 1,16,256``.

Each layer's resolution holds a plan over the batch size M (``qscheme.kernels.plan``). For a
checkpoint the plans are shown per group of identical layers (the groups of the layer table),
with the kernel for each M asked about, and under them every boundary the plans use: the
kernel's declared ``BatchRange`` and the measurement it comes from (its ``source``), or the
user's override (``--m-split`` / QSCHEME_M_SPLIT).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from qscheme.kernels.declaration import describe_batch
from qscheme.kernels.plan import KernelPlan, MSplit

if TYPE_CHECKING:
    from qscheme.checkpoint.resolve import LayerDecision
    from qscheme.kernels.problem import Problem


def boundaries(plans: Sequence[tuple[KernelPlan, str, Problem | None]]) -> list[dict[str, object]]:
    """Every (kernel, range) the plans use, once: its declared range on the device type for the
    layer, where the boundary comes from, and the range the plan gives it (which an override may
    move)."""
    seen: dict[tuple[str, int, int | None], dict[str, object]] = {}
    for plan, device_type, problem in plans:
        if not plan.split and plan.m_split is None:
            continue
        for entry in plan.entries:
            key = (entry.kernel.name, entry.m_min, entry.m_max)
            if key in seen:
                continue
            declared = entry.kernel.batch_entry(device_type, problem)
            seen[key] = {
                "kernel": entry.kernel.name,
                "m_min": entry.m_min,
                "m_max": entry.m_max,
                "reason": entry.reason,
                "declared": None if declared is None else {"m_min": declared.m_min, "m_max": declared.m_max},
                "source": None if declared is None else declared.source or None,
                "override": plan.m_split.text if plan.m_split is not None else None,
            }
    return list(seen.values())


def _plans(decisions: Sequence[LayerDecision]) -> list[tuple[KernelPlan, str, Problem | None]]:
    return [
        (d.resolution.plan, d.resolution.device.type, d.resolution.problem)
        for d in decisions
        if d.resolution.plan.entries
    ]


def render_plans(
    groups: Sequence[tuple[str, LayerDecision, int]],
    decisions: Sequence[LayerDecision],
    batch_sizes: Sequence[int],
    m_split: MSplit | None,
) -> str:
    """The plans section under the layer table: one line per group of identical layers
    (``qscheme.checkpoint.resolve.group_decisions``)."""
    asked = f" (--m {','.join(str(m) for m in batch_sizes)})" if batch_sizes else ""
    lines = [f"plans over M, the input's rows (x.numel() // K){asked}:"]
    if m_split is not None:
        lines.append(f"override: {m_split.text}")
    for pattern, decision, _ in groups:
        plan = decision.resolution.plan
        if not plan.entries:
            lines.append(f"  {pattern}: no kernel")
            continue
        lines.append(f"  {pattern}: {plan.describe()}")
        if batch_sizes:
            lines.append("    " + "  ".join(f"M={m}: {plan.kernel_for(m).name}" for m in batch_sizes))
    found = boundaries(_plans(decisions))
    if found:
        lines.append("boundaries:")
        for item in found:
            range_text = describe_batch(item["m_min"], item["m_max"])  # type: ignore[arg-type]
            declared = item["declared"]
            if isinstance(declared, dict):
                said = describe_batch(declared["m_min"], declared["m_max"])
                origin = f"declared {said}, from: {item['source'] or 'no source given'}"
            else:
                origin = "no declared range"
            lines.append(f"  {item['kernel']} {range_text} ({item['reason']}): {origin}")
    else:
        lines.append("boundaries: none (one kernel runs every M of every layer)")
    return "\n".join(lines)


def plan_json(
    decisions: Sequence[LayerDecision], batch_sizes: Sequence[int], m_split: MSplit | None
) -> dict[str, object]:
    """``plans`` (per layer: the plan's entries and the kernel for each M asked about),
    ``boundaries`` and ``plan_override`` for ``--json``."""
    return {
        "plans": [
            {
                "layer": d.name,
                "plan": d.resolution.plan.as_json(),
                "batch_sizes": [
                    {"m": m, "kernel": d.resolution.plan.kernel_for(m).name}
                    for m in batch_sizes
                    if d.resolution.plan.entries
                ],
            }
            for d in decisions
        ],
        "boundaries": boundaries(_plans(decisions)),
        "plan_override": m_split.text if m_split is not None else None,
    }
