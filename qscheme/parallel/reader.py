"""Which bytes one tensor-parallel rank reads: the reader strategy of ``load_checkpoint``.

``qscheme.checkpoint.load`` runs one pipeline (plan, split, value checks, canonical tensors,
fuse, build) and asks its reader what to read. A single process reads whole tensors and splits
nothing; ``RankReader`` splits every layer by the TP plan and the descriptor rules
(``shard_layers``, ShardError before a byte of tensor data is read) and reads only this rank's
slices of each member (``read_slice``), counted, so that a member is checked and canonicalized
as a layer of the shard's N x K.

A column-parallel layer's bias is split with N; a row-parallel layer's bias is kept by rank 0
only, so that summing (all-reducing) the ranks' outputs adds it once. Plain tensors
(embeddings, norms, ignored layers) are read whole on every rank.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qscheme.checkpoint.plan import Plan
from qscheme.parallel.plan import LayerShard, TPPlan, shard_layers
from qscheme.parallel.rules import ShardError, ShardLayout
from qscheme.storage import ReadCounter, read_slice, read_whole
from qscheme.tensor_checks import BIAS, ModuleLayout


class RankReader:
    """Rank ``tp_rank`` of ``tp_size`` under ``tp_plan``: after ``split``, ``shards`` holds every
    layer's split and ``counter`` the tensor bytes read, per tensor name."""

    def __init__(self, tp_rank: int, tp_size: int, tp_plan: TPPlan) -> None:
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.tp_plan = tp_plan
        self.counter = ReadCounter()
        self.shards: dict[str, LayerShard] = {}
        self.where = f" on rank {tp_rank}"
        self._members: dict[str, ShardLayout] = {}

    def split(self, plan: Plan) -> None:
        """Split every layer; ShardError naming every layer a split would cut."""
        shards, problems = shard_layers(plan, self.tp_plan, self.tp_size)
        if problems:
            raise ShardError(problems, f"{plan.path}: tensor parallel over {self.tp_size} ranks")
        self.shards = shards
        self._members = {
            member: shard
            for name, members in plan.layers()
            for member, shard in zip(members, shards[name].members, strict=True)
        }

    def member(self, plan: Plan, layout: ModuleLayout) -> tuple[ModuleLayout, dict[str, Tensor]]:
        """The member's layout at the shard's N x K, and this rank's tensors of it by short name
        (its bias share under ``BIAS``)."""
        shard = self._members[layout.module]
        rank = self.tp_rank
        tensors: dict[str, Tensor] = {}
        for short, info in layout.declared.items():
            split = shard.tensors.get(short)
            if split is None:  # not a declared role (cannot happen for a checked layout): read it whole
                tensors[short] = read_whole(info, self.counter)
            elif split.rewrite:
                tensors[short] = torch.tensor([shard.shard_n, shard.shard_k], dtype=torch.int64)
            else:
                tensors[short] = split.values(rank, read_slice(info, split.index(rank), self.counter))
        bias = None
        if layout.bias is not None:
            if shard.style == "column":
                size = shard.shard_n
                bias = read_slice(layout.bias, [slice(rank * size, (rank + 1) * size)], self.counter)
            elif shard.style == "replicate" or rank == 0:
                bias = read_whole(layout.bias, self.counter)
        if bias is not None:
            tensors[BIAS] = bias
        checked = ModuleLayout(
            module=layout.module,
            scheme=layout.scheme,
            n=shard.shard_n,
            k=shard.shard_k,
            declared=layout.declared,
            tolerated=layout.tolerated,
            bias=layout.bias if bias is not None else None,
        )
        return checked, tensors

    def whole(self, plan: Plan, name: str) -> Tensor:
        """A plain tensor, read whole on every rank (counted)."""
        return read_whole(plan.files.info(name), self.counter)

    def origin(self, name: str, origin: str) -> str:
        return f"{origin}; {self.shards[name].style}-parallel rank {self.tp_rank} of {self.tp_size}"

    def notes(self) -> list[str]:
        """The report's notes on the split, once everything is read."""
        notes = [f"tensor parallel: rank {self.tp_rank} of {self.tp_size}, read {self.counter.total} tensor bytes"]
        notes.extend(
            sorted({note for shard in self.shards.values() for member in shard.members for note in member.notes})
        )
        return notes
