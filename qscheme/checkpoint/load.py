"""``load_checkpoint``: a checkpoint folder -> QuantLinear per quantized module, plain tensors, a report.

Order of work, so that nothing is half-loaded: plan (config, headers, detection, layouts),
then read and check every module's scale values, then canonicalise and fuse, and only then
build the QuantLinear modules. Any problem raises one CheckpointError listing all problems
of its stage, before a single module is returned.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor

from qscheme.canonical import CanonicalWeight, canonicalize
from qscheme.checkpoint.fuse import FUSE_POLICIES, FuseOutcome, fuse_members, scales_differ
from qscheme.checkpoint.plan import FuseSpec, Plan, format_problems, plan_checkpoint
from qscheme.checkpoint.progress import Progress, auto_enabled
from qscheme.checkpoint.report import CheckpointReport, LayerReport
from qscheme.checkpoint.validate import TensorProblem, check_values
from qscheme.descriptor import Scheme
from qscheme.errors import CheckpointError, UsageError
from qscheme.linear import QuantLinear, problem_for

FusePolicyChoice = str | Mapping[str, str] | None


class Checkpoint(Mapping[str, QuantLinear]):
    """A loaded checkpoint: module name -> QuantLinear, plus ``tensors`` and ``report``.

    Module names are the checkpoint's (``model.layers.0.self_attn.q_proj``, no ``.weight``);
    a fused module is named by its parent and the fused name (``...self_attn.qkv_proj``).
    ``tensors`` holds every unquantized tensor by its full checkpoint name (embeddings, norms,
    ignored layers' weights, KV-cache scales).
    """

    def __init__(
        self,
        path: Path,
        modules: dict[str, QuantLinear],
        tensors: dict[str, Tensor],
        report: CheckpointReport,
        plan: Plan,
    ) -> None:
        self.path = path
        self.modules = modules
        self.tensors = tensors
        self.report = report
        self.plan = plan

    def __getitem__(self, name: str) -> QuantLinear:
        return self.modules[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.modules)

    def __len__(self) -> int:
        return len(self.modules)

    def __repr__(self) -> str:
        return (
            f"Checkpoint({str(self.path)!r}, {len(self.modules)} quantized modules, {len(self.tensors)} plain tensors)"
        )

    @property
    def producer(self) -> str:
        return self.report.producer

    def canonical(self, name: str) -> CanonicalWeight:
        """The canonical tensors behind one module (``module.weight_canonical``)."""
        return self.modules[name].weight_canonical


def _policy_for(name: str, choice: FusePolicyChoice) -> str | None:
    if choice is None:
        return None
    policy = choice.get(name, choice.get(name.rpartition(".")[2])) if isinstance(choice, Mapping) else choice
    if policy is not None and policy not in FUSE_POLICIES:
        raise UsageError(f"fuse policy {policy!r} for {name} is not one of {', '.join(FUSE_POLICIES)}")
    return policy


def choose_fuse_policy(
    name: str,
    scheme: Scheme,
    members: Sequence[CanonicalWeight],
    device: torch.device,
    kernel: str | None,
    activation_dtype: str,
    requested: str | None,
) -> tuple[str, str]:
    """(policy, why): the user's choice, else the scheme's policy, falling back as it declares
    when no kernel on this device takes one scale per partition."""
    if requested is not None:
        return requested, "requested"
    if not scales_differ(members):
        return "per_partition", "scales equal"
    policy = scheme.fused.policy
    if policy != "per_partition":
        return policy, f"scheme {scheme.name} policy"
    from qscheme.checkpoint.fuse import concatenate
    from qscheme.kernels.registry import resolve_layer

    problem = problem_for(concatenate(members), activation_dtype, name)
    resolution = resolve_layer(scheme, problem, _facts_device(device), kernel)
    if resolution.kernel is not None:
        return "per_partition", f"kernel {resolution.kernel.name} takes one scale per partition"
    return scheme.fused.fallback, (
        f"no kernel on {device.type} takes per-partition scales; scheme {scheme.name} falls back to "
        f"{scheme.fused.fallback}"
    )


def _facts_device(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else device.type


def _bias(plan: Plan, members: Sequence[str], n_by_member: Sequence[int]) -> Tensor | None:
    biases = [plan.layouts[m].bias for m in members]
    if all(b is None for b in biases):
        return None
    values = []
    dtype = next(plan.files.get(b.name).dtype for b in biases if b is not None)
    for info, n in zip(biases, n_by_member, strict=True):
        values.append(plan.files.get(info.name) if info is not None else torch.zeros(n, dtype=dtype))
    return values[0] if len(values) == 1 else torch.cat([v.to(dtype) for v in values])


def load_canonical(plan: Plan, progress: Progress | None = None) -> dict[str, CanonicalWeight]:
    """Every planned module's canonical tensors, after the value checks; raises on any problem."""
    if plan.problems:
        raise CheckpointError(
            f"{plan.path}: {len(plan.problems)} problem(s) found, nothing was loaded:\n{format_problems(plan.problems)}"
        )
    canonical: dict[str, CanonicalWeight] = {}
    problems: list[TensorProblem] = []
    for module, layout in plan.layouts.items():
        tensors = plan.files.get_many({short: info.name for short, info in layout.declared.items()})
        found = check_values(layout, tensors)
        problems.extend(found)
        if not found and not problems:
            canonical[module] = canonicalize(layout.scheme, tensors, layout.n, layout.k)
        if progress is not None:
            progress.advance(item=module)
    if problems:
        raise CheckpointError(
            f"{plan.path}: {len(problems)} problem(s) found, nothing was loaded:\n{format_problems(problems)}"
        )
    return canonical


def load_checkpoint(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    kernel: str | None = None,
    fuse: FuseSpec | None = None,
    fuse_policy: FusePolicyChoice = None,
    activation_dtype: str = "bfloat16",
    schemes: Iterable[Scheme] | None = None,
    progress: bool | None = None,
) -> Checkpoint:
    """Load a compressed-tensors or ModelOpt checkpoint folder exactly.

    ``kernel`` forces one kernel for every layer; ``fuse`` builds one module from several
    (``{"qkv_proj": ["q_proj", "k_proj", "v_proj"]}``); ``fuse_policy`` ("per_partition",
    "rescale", "requantize", "refuse", or a mapping fused name -> policy) overrides what the
    scheme and the kernels decide for fused members whose scales differ. Raises CheckpointError
    (nothing loaded) on any malformed config, file or tensor.
    """
    torch_device = torch.device(device)
    plan = plan_checkpoint(path, schemes=schemes, fuse=fuse)
    show = auto_enabled(plan.files.total_bytes, progress)
    layers = plan.layers()
    with Progress(len(plan.layouts) + len(layers), "loading", enabled=show) as bar:
        canonical = load_canonical(plan, bar)
        modules: dict[str, QuantLinear] = {}
        reports: list[LayerReport] = []
        for name, members in layers:
            weights = [canonical[m] for m in members]
            outcome: FuseOutcome | None = None
            reason = ""
            if len(members) == 1:
                weight = weights[0]
            else:
                requested = _policy_for(name, fuse_policy)
                policy, reason = choose_fuse_policy(
                    name, weights[0].scheme, weights, torch_device, kernel, activation_dtype, requested
                )
                weight, outcome = fuse_members(name, members, weights, policy)
            bias = _bias(plan, members, [w.n for w in weights])
            layer = QuantLinear.from_canonical(
                weight,
                device=torch_device,
                kernel=kernel,
                bias=bias,
                layer_name=name,
                activation_dtype=activation_dtype,
            )
            modules[name] = layer
            layouts = [plan.layouts[m] for m in members]
            reports.append(
                LayerReport(
                    name=name,
                    scheme=weight.scheme.name,
                    n=weight.n,
                    k=weight.k,
                    origin=plan.detection.modules[members[0]].origin,
                    members=tuple(members),
                    kernel=layer.kernel.name,
                    tolerated=tuple(f"{lay.module}.{t}" for lay in layouts for t in lay.tolerated),
                    fuse=outcome,
                    fuse_reason=reason,
                )
            )
            bar.advance(item=name)
    detection = plan.detection
    tensors = {name: plan.files.get(name) for name in (*detection.plain, *detection.kv_cache)}
    if torch_device.type != "cpu":
        tensors = {name: value.to(torch_device) for name, value in tensors.items()}
    report = CheckpointReport(
        path=str(plan.path),
        producer=plan.config.producer,
        producer_version=plan.config.producer_version,
        config_file=getattr(plan.config, "file", None),
        files=tuple(p.name for p in plan.files.files),
        total_bytes=plan.files.total_bytes,
        layers=tuple(reports),
        ignored=detection.ignored,
        plain_tensors=detection.plain,
        kv_cache_tensors=detection.kv_cache,
        tolerated_tensors=tuple(t for r in reports for t in r.tolerated),
        notes=tuple(plan.notes),
    )
    return Checkpoint(plan.path, modules, tensors, report, plan)
