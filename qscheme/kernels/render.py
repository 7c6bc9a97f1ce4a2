"""Rendering resolutions: the trace table, the decision, the no-kernel message, and JSON.

The trace lists every failing check of every kernel, one a row, with the check's hint (a
plugin's own checks give theirs) under it, in text as in JSON.

Pure string building; no I/O. The no-kernel message is snapshot-tested (tests/snapshots/).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from qscheme.kernels.declaration import KernelDeclaration
from qscheme.kernels.features import SchemeFeatures, activation_matches, formats_differ

if TYPE_CHECKING:  # annotations only: the resolver raises with the message rendered here
    from qscheme.kernels.resolver import Candidate, Resolution

TRACE_HEADER: tuple[str, ...] = ("kernel", "provider", "priority", "verdict", "stage", "reason")


def text_table(rows: Sequence[Sequence[str]], header: Sequence[str], indent: str = "") -> str:
    """Left-aligned columns separated by two spaces, a dashed rule under the header."""
    all_rows = [list(header), *[list(r) for r in rows]]
    widths = [max(len(str(r[i])) for r in all_rows) for i in range(len(header))]
    lines = [indent + "  ".join(str(c).ljust(widths[i]) for i, c in enumerate(row)).rstrip() for row in all_rows]
    lines.insert(1, indent + "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def trace_rows(candidate: Candidate) -> list[tuple[str, str, str, str, str, str]]:
    """A candidate's rows: its first failing check beside its name, then one row for each other
    failing check, each followed by the check's hint where it has one."""
    head = (candidate.kernel, candidate.provider, str(candidate.priority), candidate.verdict)
    if not candidate.failures:
        return [(*head, candidate.stage or "-", candidate.reason or "-")]
    rows: list[tuple[str, str, str, str, str, str]] = []
    for index, failure in enumerate(candidate.failures):
        rows.append((*(head if index == 0 else ("", "", "", "")), failure.stage, failure.reason))
        if failure.hint:
            rows.append(("", "", "", "", "", f"hint: {failure.hint}"))
    return rows


def trace_table(resolution: Resolution, indent: str = "") -> str:
    rows = [row for candidate in resolution.trace for row in trace_rows(candidate)]
    return text_table(rows, TRACE_HEADER, indent)


def decision_line(resolution: Resolution) -> str:
    scheme = resolution.scheme.name
    if resolution.kernel is not None:
        forced = " (forced)" if resolution.forced else ""
        at = " at M = 1 (the plan below gives every M)" if resolution.plan.split else ""
        return f"kernel: {resolution.kernel.name}{forced} for scheme {scheme}{at}"
    if resolution.layout is not None:
        problem = resolution.problem
        return f"kernel: none: scheme {scheme} cannot store a layer of N={problem.n}, K={problem.k} (see layout)"
    if resolution.forced:
        return f"kernel: none: forced kernel {resolution.forced!r} cannot run scheme {scheme}"
    return f"kernel: none can run scheme {scheme}"


def plan_lines(resolution: Resolution, batch_sizes: Sequence[int] = ()) -> list[str]:
    """The plan, when more than one kernel runs the layer or ``batch_sizes`` are asked about:
    ``plan: M <= 15: cpu_gemv; M >= 16: dequant_gemm`` and one ``M=16: dequant_gemm`` line per
    batch size. Nothing for a one-kernel plan asked about nothing (the decision line says it)."""
    plan = resolution.plan
    if not plan.entries or (not plan.split and not batch_sizes):
        return []
    lines = [f"plan: {plan.describe()}"]
    if plan.m_split is not None:
        lines.append(f"plan override: {plan.m_split.text}")
    lines.extend(f"  M={m}: {plan.kernel_for(m).name}" for m in batch_sizes)
    return lines


def render_resolution(
    resolution: Resolution,
    failures: Sequence[object] = (),
    hint: str = "",
    declarations: Sequence[KernelDeclaration] | None = None,
    batch_sizes: Sequence[int] = (),
) -> str:
    """What `qscheme resolve` prints: decision, device and problem lines, the plan (when several
    kernels run the layer, or ``batch_sizes`` are asked about), the trace table; when unresolved
    also what kernels accept for the weights (given ``declarations``) and a hint."""
    lines = [
        decision_line(resolution),
        f"device: {resolution.device.describe()}",
        f"problem: {resolution.problem.describe()}",
        *plan_lines(resolution, batch_sizes),
    ]
    if resolution.layout is not None:
        lines.append(f"layout: {resolution.layout.reason}")
    lines.extend(f"note: {note}" for note in resolution.device.notes)
    if resolution.kernel is None and declarations is not None:
        lines.extend(_pairing_section(resolution, declarations))
    lines.extend(["", trace_table(resolution)])
    if failures:
        lines.extend(["", "plugin errors (see `qscheme plugins`):"])
        lines.extend(f"  {failure}" for failure in failures)
    if hint and resolution.kernel is None:
        lines.extend(["", f"hint: {hint}"])
    return "\n".join(lines)


def resolution_json(
    resolution: Resolution,
    failures: Sequence[object] = (),
    hint: str = "",
    declarations: Sequence[KernelDeclaration] | None = None,
    batch_sizes: Sequence[int] = (),
) -> dict[str, object]:
    pairings = None
    if resolution.kernel is None and declarations is not None:
        features = SchemeFeatures.of(resolution.scheme)
        family = features.weight_family
        formats = formats_differ(family, features.activation, (s for d in declarations for s in d.supports))
        pairings = [
            {"activations": described, "kernels": kernels}
            for described, kernels in activation_pairings(family, declarations, formats)
        ]
    return {
        "scheme": resolution.scheme.name,
        "kernel": resolution.kernel.name if resolution.kernel else None,
        "forced": resolution.forced,
        "disabled": sorted(resolution.disabled),
        "device": resolution.device.as_json(),
        "problem": resolution.problem.as_json(),
        "layout": resolution.layout.as_json() if resolution.layout is not None else None,
        "plan": resolution.plan.as_json(),
        "plan_override": resolution.plan.m_split.text if resolution.plan.m_split is not None else None,
        "batch_sizes": [
            {"m": m, "kernel": resolution.plan.kernel_for(m).name} for m in batch_sizes if resolution.plan.entries
        ],
        "trace": [c.as_json() for c in resolution.trace],
        "pairings": pairings,
        "hint": hint or None,
        "plugin_failures": [str(f) for f in failures],
    }


def activation_pairings(
    weight_family: str, declarations: Iterable[KernelDeclaration], formats: bool = False
) -> list[tuple[str, list[str]]]:
    """For one weight family: each activation format some kernel accepts, and which kernels
    (described with element and scale formats when ``formats``)."""
    table: dict[str, list[str]] = {}
    for declaration in sorted(declarations, key=KernelDeclaration.sort_key):
        for supports in declaration.supports:
            if weight_family not in supports.weights:
                continue
            for activation in supports.activations:
                kernels = table.setdefault(activation.describe(formats), [])
                if declaration.name not in kernels:
                    kernels.append(declaration.name)
    return sorted(table.items(), key=lambda item: (item[0] != "none (16-bit)", item[0]))


def _pairing_section(resolution: Resolution, declarations: Sequence[KernelDeclaration]) -> list[str]:
    """When no kernel takes the scheme's weight and activation pairing: what kernels do take."""
    features = SchemeFeatures.of(resolution.scheme)
    family, activation = features.weight_family, features.activation
    pairs = any(
        family in s.weights and any(activation_matches(a, activation) for a in s.activations)
        for d in declarations
        for s in d.supports
    )
    if pairs:
        return []
    # Formats are named only when they are what no kernel takes.
    formats = formats_differ(family, activation, (s for d in declarations for s in d.supports))
    pairings = activation_pairings(family, declarations, formats)
    head = f"No kernel implements {family} weights with {activation.describe(formats)} activations."
    if not pairings:
        return [head, f"No kernel implements {family} weights at all."]
    rows = [(described, ", ".join(kernels)) for described, kernels in pairings]
    return [
        head,
        f"Activation formats that kernels accept with {family} weights:",
        text_table(rows, ("activations", "kernels"), indent="  "),
    ]


def no_kernel_message(
    resolution: Resolution,
    failures: Sequence[object] = (),
    hint: str = "",
    declarations: Sequence[KernelDeclaration] | None = None,
) -> str:
    """The NoKernelError text: layer, shape, device, pairing summary, trace, plugin failures, hint.

    ``declarations`` (all known kernels) enables the pairing summary; without it the message is
    built from the trace alone.
    """
    problem = resolution.problem
    layer = f"layer {problem.layer}" if problem.layer else "the layer"
    shape = f"N={problem.n}, K={problem.k}, {problem.activation_dtype} activations"
    if problem.partitions > 1:
        differ = "different" if problem.partition_scales_differ else "equal"
        shape += f", {problem.partitions} fused partitions with {differ} scales"
    if resolution.layout is not None:
        head = f"the scheme cannot store {layer}"
    elif resolution.forced:
        head = f"forced kernel {resolution.forced!r} cannot run {layer}"
    else:
        head = f"no kernel can run {layer}"
    lines = [
        f"{head} (scheme {resolution.scheme.name}; {shape})",
        f"device: {resolution.device.describe()}",
    ]
    if resolution.layout is not None:
        lines.append(f"layout: {resolution.layout.reason}")
    if declarations is not None:
        section = _pairing_section(resolution, declarations)
        if section:
            lines.extend(section)
    lines.extend(["candidates:", trace_table(resolution, indent="  ")])
    if failures:
        lines.append("plugin errors (see `qscheme plugins`):")
        lines.extend(f"  {failure}" for failure in failures)
    if hint:
        lines.append(f"hint: {hint}")
    return "\n".join(lines)
