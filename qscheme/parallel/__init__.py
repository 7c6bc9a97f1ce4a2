"""Tensor parallelism derived from scheme descriptors: split rules, TP plans, per-rank loading.

* ``rules``: how each stored tensor of a scheme splits when a layer splits N (column-parallel)
  or K (row-parallel), and ShardError when a split would cut a packed word, a scale group or
  block, or an activation group;
* ``plan``: which layers split which way (Llama default, or a mapping of module patterns);
* ``read_slice`` / ``ReadCounter``: only this rank's bytes of each tensor, counted (re-exported
  from ``qscheme.storage``, which reads every file);
* ``load``: ``load_checkpoint_tp``, one rank's shard-sized QuantLinear modules;
* ``linear``: column- and row-parallel wrappers (gather, all-reduce, or partial sums);
* ``model``: ``apply_to_model_tp``, a transformers model running tensor-parallel;
* ``resolve`` / ``report``: per-shard kernel resolution and the ``--tp`` views of the CLI.
"""

from __future__ import annotations

from qscheme.parallel.linear import ColumnParallelLinear, RowParallelLinear
from qscheme.parallel.load import ShardedCheckpoint, load_checkpoint_tp
from qscheme.parallel.model import apply_to_model_tp
from qscheme.parallel.plan import DEFAULT_TP_PLAN, LayerShard, TPPlan, checked_tp_plan, shard_layers
from qscheme.parallel.rules import (
    ShardError,
    ShardLayout,
    SplitProblem,
    Style,
    TensorShard,
    shard_layout,
    split_multiple,
    working_degrees,
)
from qscheme.storage import ReadCounter, read_slice

__all__ = [
    "DEFAULT_TP_PLAN",
    "ColumnParallelLinear",
    "LayerShard",
    "ReadCounter",
    "RowParallelLinear",
    "ShardError",
    "ShardLayout",
    "ShardedCheckpoint",
    "SplitProblem",
    "Style",
    "TPPlan",
    "TensorShard",
    "apply_to_model_tp",
    "checked_tp_plan",
    "load_checkpoint_tp",
    "read_slice",
    "shard_layers",
    "shard_layout",
    "split_multiple",
    "working_degrees",
]
