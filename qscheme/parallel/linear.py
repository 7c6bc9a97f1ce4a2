"""Column- and row-parallel wrappers: one rank's shard of a linear layer on torch.distributed.

A tensor-parallel linear layer is split across the ranks of the default process group (or a
group given). Each rank holds a *shard*: any module computing ``y = x @ W_shard^T`` (a
``QuantLinear`` loaded with ``load_checkpoint(path, tp_rank=r, tp_size=n)``, or a plain
``nn.Linear`` slice). The wrappers here add the communication:

- ``ColumnParallelLinear``: the shard holds this rank's output features (N is split). Its output
  stays sharded (what attention and the MLP want), or is all-gathered into the full output when
  asked (``gather=True``). A fused module (q/k/v, gate/up) is split per partition, so each rank's
  output is ``[q_r, k_r, v_r]``; gathering puts the partitions back in their unsharded order.
- ``RowParallelLinear``: the shard holds this rank's input features (K is split). Each rank
  computes a partial sum; the wrapper all-reduces it over the group, or returns it unreduced
  when told (``reduce=False``), for a caller that fuses the reduction with something else.
  The bias is added once, on rank 0 before the reduction, so partial sums always add up to the
  unsharded output (as vLLM's RowParallelLinear does).

The input's gradient flows as through the unsharded layer when the code around the layers is
replicated (every rank computes the same loss), as in Megatron-LM: a column-parallel layer's
input gradient is all-reduced (each rank contributes its rows' share), a gathered output passes
back only this rank's slice, a row-parallel layer's reduced output passes its gradient back
unchanged, and a split input gathers its slices' gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from qscheme.errors import UsageError


def _check_degree(tp_rank: int, tp_size: int, caller: str) -> None:
    """UsageError unless 0 <= tp_rank < tp_size are ints."""
    for name, value in (("tp_rank", tp_rank), ("tp_size", tp_size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise UsageError(f"{caller}: {name} must be an int, not {type(value).__name__} ({value!r})")
    if tp_size < 1:
        raise UsageError(f"{caller}: tp_size={tp_size}; pass the number of tensor-parallel ranks (1 or more)")
    if not 0 <= tp_rank < tp_size:
        raise UsageError(f"{caller}: tp_rank={tp_rank} is not in 0..{tp_size - 1} (tp_size={tp_size})")


def _checked_group(group: dist.ProcessGroup | None, tp_rank: int, tp_size: int, layer: str) -> dist.ProcessGroup | None:
    """The group to communicate over, once checked: initialised, of tp_size ranks, this rank at tp_rank."""
    if not dist.is_available() or not dist.is_initialized():
        raise UsageError(
            f"{layer}: tensor parallelism over {tp_size} ranks needs torch.distributed: call "
            "torch.distributed.init_process_group(...) first (torchrun sets its environment: "
            "init_process_group('nccl' or 'gloo') with no arguments), or load with tp_size=1"
        )
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if size != tp_size or rank != tp_rank:
        what = "the default process group" if group is None else "the process group given"
        raise UsageError(
            f"{layer}: the shard is rank {tp_rank} of {tp_size}, but this process is rank {rank} of {size} in "
            f"{what}; load with tp_rank=torch.distributed.get_rank(), tp_size=torch.distributed.get_world_size() "
            "(or pass the tensor-parallel group as group=)"
        )
    return group


def _name(shard: torch.nn.Module) -> str:
    return getattr(shard, "layer_name", None) or type(shard).__name__


class _Communicating(torch.nn.Module):
    """What both wrappers share: the shard, its place among the ranks, and the group, checked
    on first use (the group may be created after the model is built)."""

    shard: torch.nn.Module
    tp_rank: int
    tp_size: int
    group: dist.ProcessGroup | None
    _group_checked: bool = False

    def _group(self) -> dist.ProcessGroup | None:
        if not self._group_checked:
            _checked_group(self.group, self.tp_rank, self.tp_size, _name(self.shard))
            self._group_checked = True
        return self.group


class ColumnParallelLinear(_Communicating):
    """This rank's output features of a linear layer (N split across the group).

    ``partitions`` are the *unsharded* output sizes of a fused module's members (q, k, v), each
    split evenly; ``(N,)`` or empty for a plain layer. ``forward`` returns the shard's output
    ``[..., N / tp_size]``, or with ``gather=True`` the full ``[..., N]`` in unsharded order.
    """

    def __init__(
        self,
        shard: torch.nn.Module,
        tp_rank: int,
        tp_size: int,
        *,
        partitions: Sequence[int] = (),
        gather: bool = False,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        _check_degree(tp_rank, tp_size, "ColumnParallelLinear")
        shard_n = int(getattr(shard, "out_features", 0))
        full = tuple(int(size) for size in partitions) or (shard_n * tp_size,)
        if any(size % tp_size for size in full) or sum(full) != shard_n * tp_size:
            raise UsageError(
                f"ColumnParallelLinear({_name(shard)}): partitions {list(full)} do not split into {tp_size} equal "
                f"shards of {shard_n} output features in all; pass the unsharded partition sizes of the layer"
            )
        self.shard = shard
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.partitions = full
        self.gather = gather
        self.group = group
        self.in_features = int(getattr(shard, "in_features", 0))
        self.out_features = sum(full) if gather else shard_n
        self.layer_name = getattr(shard, "layer_name", None)

    def forward(self, x: Tensor) -> Tensor:
        if self.tp_size > 1 and torch.is_grad_enabled() and x.requires_grad:
            x = _SumGradients.apply(x, self._group())
        y: Tensor = self.shard(x)
        if not self.gather or self.tp_size == 1:
            return y
        pieces: tuple[Tensor, ...] = _Gather.apply(y, self.tp_rank, self.tp_size, self._group())
        local = [size // self.tp_size for size in self.partitions]
        by_rank = [piece.split(local, dim=-1) for piece in pieces]
        # partition p of the full output is partition p of rank 0, then of rank 1, ...
        return torch.cat([by_rank[r][p] for p in range(len(local)) for r in range(self.tp_size)], dim=-1)

    def extra_repr(self) -> str:
        return (
            f"tp_rank={self.tp_rank}, tp_size={self.tp_size}, partitions={list(self.partitions)}, gather={self.gather}"
        )


class RowParallelLinear(_Communicating):
    """This rank's input features of a linear layer (K split across the group).

    ``forward`` takes this rank's slice of the input ``[..., K / tp_size]`` (or the full input
    with ``split_input=True``) and returns the all-reduced ``[..., N]``, or with ``reduce=False``
    this rank's partial sum (the partial sums of all ranks add up to the output).

    The shard's bias, if it has one, moves to the wrapper (``shard.bias`` becomes None) and is
    added on rank 0 only; pass ``bias=`` for a shard loaded without it.
    """

    def __init__(
        self,
        shard: torch.nn.Module,
        tp_rank: int,
        tp_size: int,
        *,
        bias: Tensor | None = None,
        reduce: bool = True,
        split_input: bool = False,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        _check_degree(tp_rank, tp_size, "RowParallelLinear")
        own = getattr(shard, "bias", None)
        if own is not None and bias is not None:
            raise UsageError(f"RowParallelLinear({_name(shard)}): bias given twice: the shard has one and bias= too")
        if own is not None:
            bias = own
            shard.bias = None  # type: ignore[assignment]  # added here once, not by every rank's shard
        self.shard = shard
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.reduce = reduce
        self.split_input = split_input
        self.group = group
        self.shard_in_features = int(getattr(shard, "in_features", 0))
        self.in_features = self.shard_in_features * tp_size
        self.out_features = int(getattr(shard, "out_features", 0))
        self.layer_name = getattr(shard, "layer_name", None)
        self.bias: Tensor | None
        if bias is not None:
            if tuple(bias.shape) != (self.out_features,):
                raise UsageError(
                    f"RowParallelLinear({_name(shard)}): bias has shape {list(bias.shape)}; the layer has "
                    f"N={self.out_features} outputs"
                )
            self.register_buffer("bias", bias.detach())
        else:
            self.bias = None

    def forward(self, x: Tensor) -> Tensor:
        if self.split_input:
            if x.shape[-1] != self.in_features:
                raise UsageError(
                    f"{_name(self.shard)}: split_input=True takes the full input [..., {self.in_features}], "
                    f"got {list(x.shape)}"
                )
            if self.tp_size > 1 and torch.is_grad_enabled() and x.requires_grad:
                x = _Split.apply(x, self.tp_rank, self.tp_size, self._group())
            else:
                x = x.narrow(-1, self.tp_rank * self.shard_in_features, self.shard_in_features)
        y: Tensor = self.shard(x)
        if self.bias is not None and self.tp_rank == 0:
            y = y + self.bias.to(y.dtype)
        if not self.reduce or self.tp_size == 1:
            return y
        group = self._group()
        if torch.is_grad_enabled() and y.requires_grad:
            reduced: Tensor = _Sum.apply(y, group)
            return reduced
        y = y.contiguous()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
        return y

    def extra_repr(self) -> str:
        return f"tp_rank={self.tp_rank}, tp_size={self.tp_size}, reduce={self.reduce}, bias={self.bias is not None}"


# -- collectives with tensor-parallel gradients (the code around the layers is replicated) -----


class _SumGradients(torch.autograd.Function):
    """Forward: the input as is. Backward: the gradient summed over the ranks (each rank's
    column shard contributes the part of the input's gradient its rows give)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


class _Sum(torch.autograd.Function):
    """Forward: the partial sums all-reduced. Backward: the gradient as is (every rank holds the
    same reduced output, so each partial sum gets the same gradient)."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, group: dist.ProcessGroup | None) -> Tensor:
        out = y.contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _Gather(torch.autograd.Function):
    """Forward: every rank's output (one tensor per rank). Backward: this rank's own gradient
    (every rank computes the same loss from the gathered output)."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, rank: int, size: int, group: dist.ProcessGroup | None) -> tuple[Tensor, ...]:
        ctx.rank = rank
        y = y.contiguous()
        pieces = [torch.empty_like(y) for _ in range(size)]
        dist.all_gather(pieces, y, group=group)
        return tuple(pieces)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor, None, None, None]:
        return grads[ctx.rank], None, None, None


class _Split(torch.autograd.Function):
    """Forward: this rank's slice of the last dimension. Backward: the slices' gradients of all
    ranks gathered into the whole input's gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, rank: int, size: int, group: dist.ProcessGroup | None) -> Tensor:
        ctx.size, ctx.group = size, group
        part = x.shape[-1] // size
        return x.narrow(-1, rank * part, part).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        grad = grad.contiguous()
        pieces = [torch.empty_like(grad) for _ in range(ctx.size)]
        dist.all_gather(pieces, grad, group=ctx.group)
        return torch.cat(pieces, dim=-1), None, None, None
