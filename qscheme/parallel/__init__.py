"""Tensor parallelism derived from scheme descriptors: split rules, TP plans, per-rank loading.

* ``rules``: how each stored tensor of a scheme splits when a layer splits N (column-parallel)
  or K (row-parallel), and ShardError when a split would cut a packed word, a scale group or
  block, or an activation group;
* ``plan``: which layers split which way (Llama default, or a mapping of module patterns);
* ``read_slice`` / ``ReadCounter``: only this rank's bytes of each tensor, counted (re-exported
  from ``qscheme.storage``, which reads every file);
* ``reader``: the reader strategy of ``load_checkpoint`` for one rank (which bytes it reads);
  ``load_checkpoint_tp`` (one rank's shard-sized QuantLinear modules) is that one pipeline's
  tensor-parallel entry, in ``qscheme.checkpoint.load``;
* ``linear``: column- and row-parallel wrappers (gather, all-reduce, or partial sums);
* ``model``: ``RankSplit``, the split ``apply_to_model_tp`` (the tensor-parallel entry of
  ``qscheme.checkpoint.model``'s one pipeline) gives a transformers model;
* ``resolve`` / ``report``: per-shard kernel resolution and the ``--tp`` views of the CLI.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qscheme.checkpoint.load import ShardedCheckpoint, load_checkpoint_tp
    from qscheme.checkpoint.model import apply_to_model_tp
    from qscheme.parallel.linear import ColumnParallelLinear, RowParallelLinear
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

# Loaded on first use: the load pipeline (qscheme.checkpoint.load) imports this package's rules,
# plans and reader, so the package must not import the pipeline back when it is first imported.
_EXPORTS: dict[str, str] = {
    "ColumnParallelLinear": "linear",
    "RowParallelLinear": "linear",
    "ShardedCheckpoint": "qscheme.checkpoint.load",
    "load_checkpoint_tp": "qscheme.checkpoint.load",
    "apply_to_model_tp": "qscheme.checkpoint.model",
    "DEFAULT_TP_PLAN": "plan",
    "LayerShard": "plan",
    "TPPlan": "plan",
    "checked_tp_plan": "plan",
    "shard_layers": "plan",
    "ShardError": "rules",
    "ShardLayout": "rules",
    "SplitProblem": "rules",
    "Style": "rules",
    "TensorShard": "rules",
    "shard_layout": "rules",
    "split_multiple": "rules",
    "working_degrees": "rules",
    "ReadCounter": "qscheme.storage",
    "read_slice": "qscheme.storage",
}

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


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'qscheme.parallel' has no attribute {name!r}")
    # A dotted value is a module elsewhere (the load and apply pipelines are qscheme.checkpoint's).
    return getattr(importlib.import_module(module if "." in module else f"qscheme.parallel.{module}"), name)
