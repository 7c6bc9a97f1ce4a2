"""``load_checkpoint_tp``: one rank's share of a checkpoint, as shard-sized QuantLinear modules.

The same steps as ``qscheme.load_checkpoint`` (plan from headers, value checks, canonical
tensors, fuse, build), with the split worked out first and only this rank's bytes read:

1. plan the checkpoint and split every layer by the TP plan and the descriptor rules
   (``shard_layers``); any layer that cannot be split raises ShardError before a byte of
   tensor data is read;
2. read each member's slices (``read_slice``), check their values and canonicalize them as a
   layer of the shard's N x K, so kernels and fused-partition logic see an ordinary layer;
3. fuse members per rank (each member split on its own, so q, k and v rows stay aligned and
   per-partition global scales stay with their rows), and build the QuantLinear.

A column-parallel layer's bias is split with N; a row-parallel layer's bias is kept by rank 0
only, so that summing (all-reducing) the ranks' outputs adds it once. Plain tensors
(embeddings, norms, ignored layers) are read whole on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from qscheme.canonical import CanonicalWeight, canonicalize
from qscheme.checkpoint.load import (
    Checkpoint,
    FusePolicyChoice,
    build_layer,
    check_fuse_policy,
    checked_schemes,
    checkpoint_report,
)
from qscheme.checkpoint.plain import plain_problems
from qscheme.checkpoint.plan import FuseSpec, Plan, check_fuse_spec, format_problems, plan_checkpoint
from qscheme.checkpoint.report import LayerReport
from qscheme.descriptor import Scheme
from qscheme.errors import CheckpointError, QuantizeError, UsageError
from qscheme.kernels.registry import checked_kernel
from qscheme.modules import QuantLinear, checked_device
from qscheme.parallel.agree import failures_shared, plan_digest
from qscheme.parallel.plan import LayerShard, TPPlan, checked_tp_plan, shard_layers
from qscheme.parallel.rules import ShardError, ShardLayout, Style, checked_degree
from qscheme.storage import Progress, ReadCounter, auto_enabled, read_slice, read_whole
from qscheme.tensor_checks import BIAS, ModuleLayout, TensorProblem, check_values


class ShardedCheckpoint(Checkpoint):
    """A Checkpoint holding rank ``tp_rank`` of ``tp_size``: shard-sized modules plus the split.

    ``shards[name]`` says how each layer was split (style, shard N and K, every tensor's
    slice); ``bytes_read`` counts the tensor bytes this rank read, per tensor name.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        tp_rank: int,
        tp_size: int,
        tp_plan: TPPlan,
        shards: dict[str, LayerShard],
        bytes_read: ReadCounter,
    ) -> None:
        super().__init__(checkpoint.path, checkpoint.modules, checkpoint.tensors, checkpoint.report, checkpoint.plan)
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.tp_plan = tp_plan
        self.shards = shards
        self.bytes_read = bytes_read

    def digest(self, extra: Sequence[object] = ()) -> bytes:
        """The checksum the ranks compare: every layer's split, the plain tensors, and ``extra``."""
        return plan_digest(self.tp_size, self.shards, list(self.tensors), extra)

    def style(self, name: str) -> Style:
        """column, row or replicate: how module ``name`` was split."""
        if name not in self.shards:
            raise self._unknown(name)
        return self.shards[name].style

    def __repr__(self) -> str:
        return (
            f"ShardedCheckpoint({str(self.path)!r}, rank {self.tp_rank} of {self.tp_size}, "
            f"{len(self.modules)} quantized modules, {len(self.tensors)} plain tensors)"
        )


def _member_tensors(
    layout: ModuleLayout, shard: ShardLayout, rank: int, counter: ReadCounter
) -> tuple[dict[str, Tensor], Tensor | None]:
    """This rank's stored tensors of one member (by short name), and its bias share."""
    tensors: dict[str, Tensor] = {}
    for short, info in layout.declared.items():
        split = shard.tensors.get(short)
        if split is None:  # not a declared role (cannot happen for a checked layout): read it whole
            tensors[short] = read_whole(info, counter)
        elif split.rewrite:
            tensors[short] = torch.tensor([shard.shard_n, shard.shard_k], dtype=torch.int64)
        else:
            tensors[short] = read_slice(info, split.index(rank), counter)
    bias = None
    if layout.bias is not None:
        if shard.style == "column":
            size = shard.shard_n
            bias = read_slice(layout.bias, [slice(rank * size, (rank + 1) * size)], counter)
        elif shard.style == "replicate" or rank == 0:
            bias = read_whole(layout.bias, counter)
    return tensors, bias


def _member_weight(
    plan: Plan, layout: ModuleLayout, shard: ShardLayout, rank: int, counter: ReadCounter
) -> tuple[CanonicalWeight | None, Tensor | None, list[TensorProblem]]:
    """One member's canonical shard, after load's value checks on what this rank read."""
    tensors, bias = _member_tensors(layout, shard, rank, counter)
    checked = ModuleLayout(
        module=layout.module,
        scheme=layout.scheme,
        n=shard.shard_n,
        k=shard.shard_k,
        declared=layout.declared,
        tolerated=layout.tolerated,
        bias=layout.bias if bias is not None else None,
    )
    problems = check_values(checked, {**tensors, **({BIAS: bias} if bias is not None else {})})
    if problems:
        return None, None, problems
    try:
        weight = canonicalize(layout.scheme, tensors, shard.shard_n, shard.shard_k, layer=layout.module)
    except QuantizeError as error:
        weight_info = layout.declared.get(layout.scheme.weight.tensor.name)
        file = str(weight_info.file) if weight_info is not None else str(plan.path)
        return None, None, [TensorProblem(file, layout.module, str(error))]
    return weight, bias, []


def _fused_bias(biases: list[Tensor | None], sizes: list[int]) -> Tensor | None:
    dtype = next((b.dtype for b in biases if b is not None), None)
    if dtype is None:
        return None
    parts = [b.to(dtype) if b is not None else torch.zeros(n, dtype=dtype) for b, n in zip(biases, sizes, strict=True)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def load_checkpoint_tp(
    path: str | Path,
    tp_rank: int,
    tp_size: int,
    tp_plan: object = None,
    *,
    device: str | torch.device = "cpu",
    kernel: str | None = None,
    fuse: FuseSpec | None = None,
    fuse_policy: FusePolicyChoice = None,
    activation_dtype: str = "bfloat16",
    schemes: Iterable[Scheme] | None = None,
    progress: bool | None = None,
    verify_ranks: bool = True,
) -> ShardedCheckpoint:
    """Load rank ``tp_rank`` of ``tp_size``: shard-sized QuantLinear modules, reading only their bytes.

    ``tp_plan`` maps module-name patterns to ``column`` / ``row`` / ``replicate`` (None: the
    Llama default of ``qscheme.parallel.plan.DEFAULT_TP_PLAN``); the other arguments are
    ``load_checkpoint``'s. UsageError for bad arguments before anything is read; ShardError
    (a CheckpointError) naming every layer a split would cut, with the degrees that would work,
    before any tensor data is read; CheckpointError as ``load_checkpoint`` for bad files.

    When the default process group is this tensor-parallel group (rank ``tp_rank`` of
    ``tp_size``), the ranks compare their plans' checksums (``qscheme.parallel.agree``) and every
    rank raises PlanMismatchError, naming the ranks that differ, unless all hold the same plan;
    a rank that fails announces it, so the others raise too. ``verify_ranks=False`` skips this,
    for a process that loads a shard alone (the group's other ranks would wait for it).
    """
    if not isinstance(path, str | Path):
        raise UsageError(f"load_checkpoint: path must be a folder path (str or Path), not {type(path).__name__}")
    tp_size, tp_rank = checked_degree(tp_size, tp_rank)
    if not isinstance(verify_ranks, bool):
        raise UsageError(f"load_checkpoint: verify_ranks must be True or False, not {verify_ranks!r}")
    what = f"load_checkpoint({str(path)!r}, tp_rank={tp_rank}, tp_size={tp_size})"
    with failures_shared(what, tp_rank, tp_size, verify_ranks) as done:
        checkpoint = _load_rank(
            path, tp_rank, tp_size, tp_plan, device, kernel, fuse, fuse_policy, activation_dtype, schemes, progress
        )
        done(checkpoint.digest())
    return checkpoint


def _load_rank(
    path: str | Path,
    tp_rank: int,
    tp_size: int,
    tp_plan: object,
    device: str | torch.device,
    kernel: str | None,
    fuse: FuseSpec | None,
    fuse_policy: FusePolicyChoice,
    activation_dtype: str,
    schemes: Iterable[Scheme] | None,
    progress: bool | None,
) -> ShardedCheckpoint:
    plan_of_ranks = checked_tp_plan(tp_plan)
    if schemes is not None:
        schemes = checked_schemes(schemes)
    torch_device = checked_device(device)
    checked_kernel(kernel, "load_checkpoint")
    check_fuse_policy(fuse_policy, check_fuse_spec(fuse))
    plan = plan_checkpoint(path, schemes=schemes, fuse=fuse)
    if plan.problems:
        raise CheckpointError(
            f"{plan.path}: {len(plan.problems)} problem(s) found, nothing was loaded:\n{format_problems(plan.problems)}"
        )
    shards, split_problems = shard_layers(plan, plan_of_ranks, tp_size)
    if split_problems:
        raise ShardError(split_problems, f"{plan.path}: tensor parallel over {tp_size} ranks")
    counter = ReadCounter()
    layers = plan.layers()
    show = auto_enabled(plan.files.total_bytes // tp_size, progress)
    built: dict[str, tuple[list[CanonicalWeight], list[Tensor | None]]] = {}
    problems: list[TensorProblem] = []
    with Progress(len(plan.layouts) + len(layers), "loading", enabled=show) as bar:
        for name, members in layers:
            weights: list[CanonicalWeight] = []
            biases: list[Tensor | None] = []
            for layout, shard in zip((plan.layouts[m] for m in members), shards[name].members, strict=True):
                weight, bias, found = _member_weight(plan, layout, shard, tp_rank, counter)
                problems.extend(found)
                if weight is not None:
                    weights.append(weight)
                    biases.append(bias)
                bar.advance(item=layout.module)
            built[name] = (weights, biases)
        if problems:
            raise CheckpointError(
                f"{plan.path}: {len(problems)} problem(s) found on rank {tp_rank}, nothing was loaded:\n"
                f"{format_problems(problems)}"
            )
        detection = plan.detection
        tensors = {name: read_whole(plan.files.info(name), counter) for name in (*detection.plain, *detection.kv_cache)}
        plain_found = plain_problems(plan.files, {name: tensors[name] for name in detection.plain})
        if plain_found:
            raise CheckpointError(
                f"{plan.path}: {len(plain_found)} problem(s) found on rank {tp_rank}, nothing was loaded:\n"
                f"{format_problems(plain_found)}"
            )
        modules: dict[str, QuantLinear] = {}
        reports: list[LayerReport] = []
        for name, members in layers:
            weights, biases = built[name]
            style = shards[name].style
            layer, layer_report = build_layer(
                plan,
                name,
                members,
                weights,
                _fused_bias(biases, [w.n for w in weights]),
                device=torch_device,
                kernel=kernel,
                activation_dtype=activation_dtype,
                fuse_policy=fuse_policy,
                origin=f"{detection.modules[members[0]].origin}; {style}-parallel rank {tp_rank} of {tp_size}",
            )
            modules[name] = layer
            reports.append(layer_report)
            bar.advance(item=name)
    if torch_device.type != "cpu":
        tensors = {name: value.to(torch_device) for name, value in tensors.items()}
    notes = [*plan.notes, f"tensor parallel: rank {tp_rank} of {tp_size}, read {counter.total} tensor bytes"]
    notes.extend(sorted({note for shard in shards.values() for member in shard.members for note in member.notes}))
    report = checkpoint_report(plan, reports, notes)
    base = Checkpoint(plan.path, modules, tensors, report, plan)
    return ShardedCheckpoint(base, tp_rank, tp_size, plan_of_ranks, shards, counter)
