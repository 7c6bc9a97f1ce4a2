"""Kernel resolution per shard: each rank's N and K go to the kernels' problem checks.

A layer that loads whole may still fail on every rank once split: a kernel tile that K / n no
longer fills (Marlin-style ``K % 128``), a group the shard cuts. ``resolve_tp`` answers, from
the headers alone (plus the few scalar scales that say whether fused partitions differ), what
each layer becomes at one degree: its style, shard shape, the kernel each shard gets and every
check that rejects a kernel at that shape. ``auto_degrees`` tries every degree up to 64 and
says at which ones every layer splits and has a kernel, and why the others fail. Degrees
that would not give every rank whole attention heads (config.json's ``num_attention_heads``
and ``num_key_value_heads``, as ``apply_to_model_tp`` requires) fail too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from qscheme.checkpoint.plan import FuseSpec, Plan, format_problems, plan_checkpoint
from qscheme.checkpoint.resolve import scales_differ
from qscheme.descriptor import Scheme
from qscheme.errors import CheckpointError
from qscheme.kernels.devices import DeviceFacts
from qscheme.kernels.problem import Problem, normalize_dtype
from qscheme.kernels.resolver import Resolution
from qscheme.parallel.heads import ATTENTION_PROJECTIONS, SAMPLE_ATTENTION, HeadCounts, head_counts
from qscheme.parallel.plan import LayerShard, TPPlan, checked_tp_plan, shard_layers
from qscheme.parallel.rules import MAX_LISTED_DEGREE, SplitProblem, Style, checked_degree, describe_degrees

SHAPE_STAGES: tuple[str, ...] = ("problem",)
"""Trace stages that depend on the layer's shape (the others are the same at every degree)."""


@dataclass(frozen=True)
class ShardDecision:
    """One layer at one degree: its split and its shard's kernel (None: no kernel, or no split)."""

    name: str
    members: tuple[str, ...]
    scheme: str
    style: Style
    tp_size: int
    n: int
    k: int
    shard_n: int
    shard_k: int
    resolution: Resolution | None
    split_problems: tuple[SplitProblem, ...] = ()
    fuse_policy: str | None = None

    @property
    def kernel(self) -> str | None:
        if self.resolution is None or self.resolution.kernel is None:
            return None
        return self.resolution.kernel.name

    @property
    def ok(self) -> bool:
        return not self.split_problems and self.kernel is not None

    def rejections(self) -> list[tuple[str, str, str]]:
        """(kernel, stage, reason) of every check that rejects a kernel at this shard's shape,
        and the scheme's own layout check when the shard is a shape the scheme cannot store."""
        if self.resolution is None:
            return []
        out: list[tuple[str, str, str]] = []
        if self.resolution.layout is not None:
            out.append(("-", "layout", self.resolution.layout.reason))
        for candidate in self.resolution.trace:
            for failure in candidate.failures:
                if failure.stage in SHAPE_STAGES:
                    out.append((candidate.kernel, failure.stage, failure.reason))
        return out

    def as_json(self) -> dict[str, object]:
        return {
            "layer": self.name,
            "members": list(self.members),
            "scheme": self.scheme,
            "style": self.style,
            "tp_size": self.tp_size,
            "n": self.n,
            "k": self.k,
            "shard_n": self.shard_n,
            "shard_k": self.shard_k,
            "kernel": self.kernel,
            "fuse_policy": self.fuse_policy,
            "split_problems": [
                {
                    "layer": p.layer,
                    "dimension": p.dimension,
                    "size": p.size,
                    "reason": p.reason,
                    "working": list(p.working),
                }
                for p in self.split_problems
            ],
            "rejections": [{"kernel": k, "stage": s, "reason": r} for k, s, r in self.rejections()],
        }


@dataclass(frozen=True)
class DegreeVerdict:
    """Whether every layer splits and has a kernel at ``tp_size``; else the first failure and a count."""

    tp_size: int
    ok: bool
    failing_layers: int = 0
    first_failure: str = ""

    def as_json(self) -> dict[str, object]:
        return {
            "tp_size": self.tp_size,
            "ok": self.ok,
            "failing_layers": self.failing_layers,
            "first_failure": self.first_failure,
        }


class _Context:
    """What every degree shares: the plan, the device, whether fused scales differ, a resolution memo."""

    def __init__(
        self,
        plan: Plan,
        tp_plan: TPPlan,
        device: DeviceFacts,
        kernel: str | None,
        dtype: str,
        heads: HeadCounts | None = None,
    ) -> None:
        self.plan = plan
        self.heads = heads
        self.tp_plan = tp_plan
        self.device = device
        self.kernel = kernel
        self.dtype = dtype
        self.differ = {name: len(m) > 1 and scales_differ(plan, m) for name, m in plan.layers()}
        self._memo: dict[tuple[object, ...], Resolution] = {}

    def resolve(self, shard: LayerShard, members: tuple[str, ...]) -> tuple[Resolution, str | None]:
        layout = self.plan.layouts[members[0]]
        scheme = layout.scheme
        differ = self.differ[shard.name]
        pre_scale = scheme.input_pre_scale is not None and scheme.input_pre_scale.name in layout.declared
        problem = Problem(shard.shard_n, shard.shard_k, self.dtype, len(members), differ, pre_scale, shard.name)
        resolution = self._resolved(scheme, problem)
        policy = None
        if len(members) > 1:  # as `qscheme resolve` decides for the whole layer
            policy = "per_partition" if differ else "shared"
            if differ and (scheme.fused.policy != "per_partition" or resolution.kernel is None):
                policy = scheme.fused.policy if scheme.fused.policy != "per_partition" else scheme.fused.fallback
                if policy != "refuse":
                    shared = Problem(problem.n, problem.k, self.dtype, len(members), False, pre_scale, shard.name)
                    resolution = self._resolved(scheme, shared)
        return resolution, policy

    def _resolved(self, scheme: Scheme, problem: Problem) -> Resolution:
        """Layers of one scheme and shard shape share a resolution (named for each layer)."""
        from qscheme.kernels import registry

        key = (scheme.name, problem)
        found = self._memo.get(key)
        if found is None:
            found = registry.resolve_layer(scheme, problem, self.device, self.kernel)
            self._memo[key] = found
        return replace(found, problem=problem)

    def splits_attention(self, name: str, members: tuple[str, ...], style: Style) -> bool:
        """Whether a layer is (or fuses) q/k/v split column-wise: its ranks need whole heads."""
        short = {member.rsplit(".", 1)[-1] for member in (name, *members)}
        return style == "column" and bool(short & set(ATTENTION_PROJECTIONS))

    def heads_problem(self, tp_size: int) -> str | None:
        """Why ``tp_size`` ranks cannot share the attention heads, for a checkpoint that quantizes no
        q/k/v (apply_to_model_tp still splits them from their plain weights when the plan says so)."""
        if self.heads is None or tp_size == 1:
            return None
        if any(self.splits_attention(n, m, "column") for n, m in self.plan.layers()):
            return None  # the quantized q/k/v layers carry the problem themselves
        styles = {self.tp_plan.style_for(f"{SAMPLE_ATTENTION}.{p}") for p in ATTENTION_PROJECTIONS}
        if "column" not in styles:
            return None
        reason = self.heads.reason(tp_size)
        if reason is None:
            return None
        degrees = describe_degrees("key/value heads", self.heads.key_value, self.heads.degrees())
        return f"attention (q/k/v split by the plan): {reason}; {degrees}"

    def _with_heads(self, decision: ShardDecision) -> ShardDecision:
        if self.heads is None or decision.tp_size == 1:
            return decision
        if not self.splits_attention(decision.name, decision.members, decision.style):
            return decision
        problem = self.heads.split_problem(decision.name, decision.scheme, decision.tp_size)
        if problem is None:
            return decision
        return replace(decision, split_problems=(*decision.split_problems, problem))

    def decisions(self, tp_size: int) -> list[ShardDecision]:
        return [self._with_heads(decision) for decision in self._decisions(tp_size)]

    def _decisions(self, tp_size: int) -> list[ShardDecision]:
        shards, problems = shard_layers(self.plan, self.tp_plan, tp_size)
        by_layer: dict[str, list[SplitProblem]] = {}
        fused = self.plan.fused_members
        for problem in problems:
            by_layer.setdefault(fused.get(problem.layer, problem.layer), []).append(problem)
        out: list[ShardDecision] = []
        for name, members in self.plan.layers():
            layouts = [self.plan.layouts[m] for m in members]
            n, k = sum(lay.n for lay in layouts), layouts[0].k
            scheme = layouts[0].scheme.name
            shard = shards.get(name)
            if shard is None:
                found = tuple(by_layer.get(name, ()))
                style = found[0].style if found else "replicate"
                out.append(ShardDecision(name, members, scheme, style, tp_size, n, k, n, k, None, found))
                continue
            resolution, policy = self.resolve(shard, members)
            out.append(
                ShardDecision(
                    name,
                    members,
                    scheme,
                    shard.style,
                    tp_size,
                    n,
                    k,
                    shard.shard_n,
                    shard.shard_k,
                    resolution,
                    (),
                    policy,
                )
            )
        return out


def _context(
    path: str | Path,
    tp_plan: object,
    device: DeviceFacts | str | None,
    kernel: str | None,
    fuse: FuseSpec | None,
    activation_dtype: str,
) -> _Context:
    from qscheme.kernels import registry

    plan_of_ranks = checked_tp_plan(tp_plan)
    dtype = normalize_dtype(activation_dtype)
    plan = plan_checkpoint(path, fuse=fuse)
    if plan.problems:
        raise CheckpointError(f"{plan.path}: {len(plan.problems)} problem(s) found:\n{format_problems(plan.problems)}")
    return _Context(plan, plan_of_ranks, registry.device_for(device), kernel, dtype, head_counts(plan.path))


def resolve_tp(
    path: str | Path,
    tp_size: int,
    *,
    tp_plan: object = None,
    device: DeviceFacts | str | None = None,
    kernel: str | None = None,
    fuse: FuseSpec | None = None,
    activation_dtype: str = "bfloat16",
) -> tuple[Plan, list[ShardDecision]]:
    """Every layer of a checkpoint split ``tp_size`` ways: shard shape and the shard's kernel."""
    tp_size, _ = checked_degree(tp_size)
    context = _context(path, tp_plan, device, kernel, fuse, activation_dtype)
    return context.plan, context.decisions(tp_size)


def verdict(tp_size: int, decisions: Sequence[ShardDecision], model_problem: str | None = None) -> DegreeVerdict:
    """One degree's verdict from its decisions: the first failing layer says why (``model_problem``:
    a reason the model as a whole cannot split, such as its attention heads, counted as one failure)."""
    failing = [d for d in decisions if not d.ok]
    if model_problem is not None:
        return DegreeVerdict(tp_size, False, len(failing) + 1, model_problem)
    if not failing:
        return DegreeVerdict(tp_size, True)
    first = failing[0]
    if first.split_problems:
        reason = str(first.split_problems[0])
    else:
        rejected = "; ".join(f"{kernel}: {reason}" for kernel, _, reason in first.rejections()[:2])
        reason = f"layer {first.name}: no kernel for the shard {first.shard_n}x{first.shard_k}" + (
            f" ({rejected})" if rejected else ""
        )
    return DegreeVerdict(tp_size, False, len(failing), reason)


def auto_degrees(
    path: str | Path,
    *,
    max_degree: int = MAX_LISTED_DEGREE,
    tp_plan: object = None,
    device: DeviceFacts | str | None = None,
    kernel: str | None = None,
    fuse: FuseSpec | None = None,
    activation_dtype: str = "bfloat16",
) -> tuple[Plan, list[DegreeVerdict]]:
    """The verdict of every degree 1..max_degree: where every layer splits and has a kernel."""
    context = _context(path, tp_plan, device, kernel, fuse, activation_dtype)
    return context.plan, [verdict(t, context.decisions(t), context.heads_problem(t)) for t in range(1, max_degree + 1)]
