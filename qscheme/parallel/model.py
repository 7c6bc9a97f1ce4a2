"""``RankSplit``: the split ``apply_to_model_tp`` gives ``apply_to_model``'s one pipeline
(``qscheme.checkpoint.model``), so that a transformers model runs tensor-parallel on
torch.distributed.

Every rank builds the whole model from the checkpoint's config (as for ``apply_to_model``) and
calls ``apply_to_model_tp(model, path, tp_rank, tp_size)``. The rank then loads only its shard
of each split layer (``load_checkpoint_tp``) and the model changes as follows:

- each column-parallel module (q/k/v, gate/up) becomes a ``ColumnParallelLinear`` whose output
  stays sharded: the rank's attention heads, its slice of the MLP's intermediate size;
- each row-parallel module (o_proj, down_proj) becomes a ``RowParallelLinear`` that
  all-reduces its partial sums over the default process group;
- planned modules the checkpoint leaves unquantized (an ignored layer) are split the same way
  from their plain weights, so that the layers around them see the sizes they expect;
- embeddings, norms, lm_head and every other module are replicated: each rank holds them whole.

Attention needs no change of code: transformers' attention reshapes the projections' output
into ``[..., -1, head_dim]``, so a rank with 1/n of the q, k and v features runs 1/n of the
heads, and the query heads per key/value head stay the same. What must hold is that every
rank gets whole heads: tp_size must divide the number of query heads and of key/value heads
(checked before anything is read; replicating key/value heads, as vLLM does when there are
fewer than ranks, is not done). Head-count attributes on the attention modules
(``num_heads``, ``num_key_value_heads``, ``hidden_size`` where a model keeps them) are set to
the rank's share, for model code that reshapes with them.

As with ``apply_to_model``, everything is checked before the model is changed: on any error
the model is left as it was. Before changing it, the ranks of the default process group compare
checksums of their plans (``qscheme.parallel.agree``): ranks that would split the model
differently, or that failed, make every rank raise PlanMismatchError naming them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist

from qscheme.checkpoint.load import Checkpoint, FusePolicyChoice, ShardedCheckpoint, load_checkpoint_tp
from qscheme.checkpoint.plan import FuseSpec
from qscheme.checkpoint.routers import router_hint
from qscheme.errors import CheckpointError, UsageError
from qscheme.modules import QuantLinear
from qscheme.parallel.linear import ColumnParallelLinear, RowParallelLinear
from qscheme.parallel.plan import TPPlan
from qscheme.parallel.rules import Style, working_degrees
from qscheme.text import listing

_HEAD_PROJECTIONS = {"q_proj": "query", "k_proj": "key/value", "v_proj": "key/value"}
_SHARED_ATTRIBUTES = ("num_heads", "num_attention_heads", "num_key_value_heads", "hidden_size")


def _listing(names: list[str]) -> str:
    return listing(names, 5, sentence=True)


def _refuse_other_group(tp_rank: int, tp_size: int) -> None:
    """UsageError when torch.distributed is initialised with another rank or size than asked for."""
    if not (dist.is_available() and dist.is_initialized()):
        return  # the wrappers check again on the first forward
    rank, size = dist.get_rank(), dist.get_world_size()
    if (rank, size) != (tp_rank, tp_size):
        raise UsageError(
            f"apply_to_model(tp_rank={tp_rank}, tp_size={tp_size}): this process is rank {rank} of {size} in the "
            "default process group; pass tp_rank=torch.distributed.get_rank(), "
            "tp_size=torch.distributed.get_world_size()"
        )


def _head_counts(attention: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """projection -> (heads, head_dim) for an attention module with ``head_dim`` and q/k/v Linear children."""
    head_dim = getattr(attention, "head_dim", None)
    if not isinstance(head_dim, int) or head_dim < 1:
        return {}
    counts: dict[str, tuple[int, int]] = {}
    for child in _HEAD_PROJECTIONS:
        projection = getattr(attention, child, None)
        if isinstance(projection, torch.nn.Linear) and projection.out_features % head_dim == 0:
            counts[child] = (projection.out_features // head_dim, head_dim)
    return counts


def check_heads(model: torch.nn.Module, tp_plan: TPPlan, tp_size: int) -> list[tuple[str, torch.nn.Module]]:
    """The attention modules whose q/k/v the plan splits, after checking every rank gets whole
    heads; UsageError naming the module, its head counts and the degrees that work otherwise."""
    attentions: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        counts = _head_counts(module)
        split = {child: c for child, c in counts.items() if tp_plan.style_for(f"{name}.{child}") == "column"}
        if not split:
            continue
        attentions.append((name, module))
        for child, (heads, _) in split.items():
            if heads % tp_size:
                working = [t for t in working_degrees(heads, 1) if all(h % t == 0 for h, _ in split.values())]
                raise UsageError(
                    f"apply_to_model(tp_size={tp_size}): {name} has {heads} {_HEAD_PROJECTIONS[child]} heads "
                    f"({child}), which {tp_size} ranks cannot share whole; every rank needs whole heads: "
                    f"tp_size {', '.join(map(str, working))} divide all of this module's head counts "
                    "(or replicate the attention with tp_plan)"
                )
    return attentions


_PAIRS = ((("q_proj", "k_proj", "v_proj"), "o_proj"), (("gate_proj", "up_proj"), "down_proj"))
"""Layers whose outputs feed one layer: the feeders split N (their outputs stay sharded) exactly
when the layer they feed splits K, so that the residual stream stays whole on every rank."""


def check_pairs(model: torch.nn.Module, tp_plan: TPPlan) -> None:
    """UsageError when the plan splits attention's q/k/v and o_proj, or the MLP's gate/up and
    down_proj, inconsistently: the feeders must be column-parallel and the layer they feed
    row-parallel, or all replicated."""
    for name, module in model.named_modules():
        for feeders, fed in _PAIRS:
            children = (*feeders, fed)
            if not all(isinstance(getattr(module, child, None), torch.nn.Linear) for child in children):
                continue
            styles = {child: tp_plan.style_for(f"{name}.{child}") for child in children}
            fed_by = {styles[feeder] for feeder in feeders}
            if (fed_by, styles[fed]) in (({"column"}, "row"), ({"replicate"}, "replicate")):
                continue
            shown = ", ".join(f"{child} {style}" for child, style in styles.items())
            raise UsageError(
                f"tp_plan splits {name} inconsistently ({shown}): {'/'.join(feeders)} column-parallel feed {fed} "
                f"row-parallel (their outputs stay sharded, {fed} takes its slice of them), or all of them are "
                "replicated; give them styles that pair so"
            )


def _target(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str, torch.nn.Linear] | None:
    """(parent, attribute, Linear) for a module name; None when the model has no such module."""
    parent_name, _, child = name.rpartition(".")
    try:
        target = model.get_submodule(name)
        parent = model.get_submodule(parent_name) if parent_name else model
    except AttributeError:
        return None
    if isinstance(target, QuantLinear | ColumnParallelLinear | RowParallelLinear):
        raise CheckpointError(
            f"model module {name!r} is already a {type(target).__name__}: apply_to_model was run on this model "
            "before; build a fresh model from the checkpoint's config.json"
        )
    if not isinstance(target, torch.nn.Linear):
        raise CheckpointError(
            f"model module {name!r} is a {type(target).__name__}, not an nn.Linear: apply_to_model replaces "
            "nn.Linear modules only; use qscheme.load_checkpoint(path, tp_rank=..., tp_size=...) and call its layers"
            + router_hint(name, type(target).__name__)
        )
    return parent, child, target


def _wrap(layer: torch.nn.Module, style: Style, rank: int, size: int, partitions: tuple[int, ...]) -> torch.nn.Module:
    if style == "column":
        return ColumnParallelLinear(layer, rank, size, partitions=partitions)
    if style == "row":
        return RowParallelLinear(layer, rank, size)
    return layer


def _plain_shard(linear: torch.nn.Linear, style: Style, rank: int, size: int, name: str) -> torch.nn.Linear:
    """An nn.Linear holding this rank's rows (column) or columns (row) of an unquantized Linear.

    The bias follows the rows of a column split; a row split's shard keeps it on rank 0 only
    (RowParallelLinear adds it there). Called after the checkpoint's values are in ``linear``.
    """
    n, k = linear.out_features, linear.in_features
    whole = n if style == "column" else k
    if whole % size:
        raise UsageError(
            f"apply_to_model(tp_size={size}): unquantized {style}-parallel module {name!r} has "
            f"{'N' if style == 'column' else 'K'} = {whole}, which {size} ranks cannot split evenly; working "
            f"degrees: {', '.join(map(str, working_degrees(whole, 1)))}; or replicate it with tp_plan"
        )
    part = whole // size
    weight = linear.weight.detach()
    bias: torch.Tensor | None = linear.bias.detach() if linear.bias is not None else None
    if style == "column":
        weight = weight[rank * part : (rank + 1) * part]
        bias = bias[rank * part : (rank + 1) * part] if bias is not None else None
        shape = (k, part)
    else:
        weight = weight[:, rank * part : (rank + 1) * part]
        bias = bias if rank == 0 else None
        shape = (part, n)
    shard = torch.nn.Linear(*shape, bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        shard.weight.copy_(weight)
        if bias is not None and shard.bias is not None:
            shard.bias.copy_(bias)
    shard.requires_grad_(linear.weight.requires_grad)
    return shard


def _quantized_swaps(
    model: torch.nn.Module, checkpoint: ShardedCheckpoint, folder: Path
) -> tuple[list[tuple[torch.nn.Module, str, torch.nn.Module]], list[str]]:
    """(parent, attribute, wrapped shard) for each quantized layer, and the layers the model lacks."""
    swaps: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []
    absent: list[str] = []
    members = dict(checkpoint.plan.layers())
    for name, layer in checkpoint.items():
        found = _target(model, name)
        if found is None:
            absent.append(name)
            continue
        parent, child, target = found
        shard = checkpoint.shards[name]
        if (target.out_features, target.in_features) != (shard.n, shard.k):
            raise CheckpointError(
                f"{folder}: module {name!r}: the model's Linear is [{target.out_features}, {target.in_features}] but "
                f"the checkpoint's weight is [{shard.n}, {shard.k}]"
            )
        layouts = [checkpoint.plan.layouts[member] for member in members.get(name, (name,))]
        if (target.bias is not None) != any(layout.bias is not None for layout in layouts):
            raise CheckpointError(
                f"{folder}: module {name!r}: the model's Linear {'has' if target.bias is not None else 'has no'} bias "
                "but the checkpoint disagrees"
            )
        partitions = tuple(member.n for member in shard.members)
        swaps.append((parent, child, _wrap(layer, shard.style, checkpoint.tp_rank, checkpoint.tp_size, partitions)))
    return swaps, absent


class RankSplit:
    """Rank ``tp_rank`` of ``tp_size`` under ``tp_plan``: the split of ``apply_to_model``'s phases
    (``qscheme.checkpoint.model.ModelSplit``). ``agree`` receives the checksum the ranks compare
    (``qscheme.parallel.agree.failures_shared``); ``checkpoint`` is the rank's, once loaded."""

    absent_advice = "build the model from the checkpoint's config.json, or pass strict=False"

    def __init__(self, tp_rank: int, tp_size: int, tp_plan: TPPlan, agree: Callable[[bytes], None]) -> None:
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.tp_plan = tp_plan
        self.what = f"apply_to_model (tensor-parallel rank {tp_rank})"
        self._agree = agree
        self.attentions: list[tuple[str, torch.nn.Module]] = []
        self.plain_split: list[tuple[str, Style]] = []
        self._checkpoint: ShardedCheckpoint | None = None

    @property
    def checkpoint(self) -> ShardedCheckpoint:
        if self._checkpoint is None:
            raise RuntimeError("RankSplit.checkpoint before load()")
        return self._checkpoint

    def check_model(self, model: torch.nn.Module) -> None:
        """The process group, the plan's pairs and whole heads, before anything is read."""
        _refuse_other_group(self.tp_rank, self.tp_size)
        check_pairs(model, self.tp_plan)
        self.attentions = check_heads(model, self.tp_plan, self.tp_size)

    def load(
        self,
        path: str | Path,
        *,
        device: torch.device,
        kernel: str | None,
        fuse: FuseSpec | None,
        fuse_policy: FusePolicyChoice,
        activation_dtype: str,
        progress: bool | None,
    ) -> ShardedCheckpoint:
        self._checkpoint = load_checkpoint_tp(
            path,
            self.tp_rank,
            self.tp_size,
            self.tp_plan,
            device=device,
            kernel=kernel,
            fuse=fuse,
            fuse_policy=fuse_policy,
            activation_dtype=activation_dtype,
            progress=progress,
            verify_ranks=False,
        )
        return self._checkpoint

    def quantized(
        self, model: torch.nn.Module, checkpoint: Checkpoint, folder: Path
    ) -> tuple[
        list[tuple[torch.nn.Module, str, torch.nn.Module]],
        list[str],
        tuple[str, ...],
        Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    ]:
        """Every quantized layer against the model's Linear (full sizes), wrapped for its style."""
        swaps, absent = _quantized_swaps(model, self.checkpoint, folder)
        replaced = tuple(f"{name}." for name in checkpoint if name not in absent)
        return swaps, absent, replaced, lambda state: state

    def check_rest(self, model: torch.nn.Module, checkpoint: Checkpoint, absent: list[str]) -> None:
        """Unquantized Linear modules the plan splits: checked now, sliced once their values are in."""
        quantized = {name for name in checkpoint if name not in absent}
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name not in quantized:
                style = self.tp_plan.style_for(name)
                if style != "replicate":
                    whole = module.out_features if style == "column" else module.in_features
                    if whole % self.tp_size:
                        _plain_shard(module, style, self.tp_rank, self.tp_size, name)  # raises, naming the degrees
                    self.plain_split.append((name, style))

    def agree(self, absent: list[str]) -> None:
        """Every rank must split the same layers the same way before any of them communicates."""
        extra = [sorted(self.plain_split), sorted(absent), sorted(name for name, _ in self.attentions)]
        self._agree(self.checkpoint.digest(extra))

    def before_swaps(self, model: torch.nn.Module) -> None:
        """The unquantized split modules, sliced now that the checkpoint's values are in them."""
        for name, style in self.plain_split:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            linear = cast(torch.nn.Linear, model.get_submodule(name))  # listed from named_modules above
            shard = _plain_shard(linear, style, self.tp_rank, self.tp_size, name)
            setattr(parent, child, _wrap(shard, style, self.tp_rank, self.tp_size, (linear.out_features,)))

    def after_swaps(self, model: torch.nn.Module) -> None:
        """Head-count attributes set to the rank's share."""
        for _, attention in self.attentions:
            for attribute in _SHARED_ATTRIBUTES:
                count = attention.__dict__.get(attribute)
                if isinstance(count, int) and not isinstance(count, bool) and count % self.tp_size == 0:
                    setattr(attention, attribute, count // self.tp_size)

    def notes(self) -> list[str]:
        notes = [f"apply_to_model: tensor parallel, rank {self.tp_rank} of {self.tp_size}"]
        if self.plain_split:
            notes.append(
                f"apply_to_model: unquantized modules split by the plan: {_listing([n for n, _ in self.plain_split])}"
            )
        return notes
