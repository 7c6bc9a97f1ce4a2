"""Tensor-parallel plans: the Llama default, pattern overrides, fused modules' styles."""

from __future__ import annotations

from pathlib import Path

import pytest
from parallel_checkpoints import write_checkpoint

from qscheme.checkpoint.plan import plan_checkpoint
from qscheme.errors import UsageError
from qscheme.parallel import DEFAULT_TP_PLAN, checked_tp_plan, shard_layers


def test_the_default_is_llama_style() -> None:
    plan = checked_tp_plan(None)
    assert plan.default and dict(plan.entries) == dict(DEFAULT_TP_PLAN)
    styles = {m: plan.style_for(f"model.layers.7.{m}") for m in ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj")}
    assert styles == {"self_attn.q_proj": "column", "self_attn.o_proj": "row", "mlp.up_proj": "column"}
    assert plan.style_for("model.layers.0.mlp.down_proj") == "row"
    assert plan.style_for("lm_head") == "replicate"


def test_patterns_match_trailing_parts_and_the_first_match_wins() -> None:
    plan = checked_tp_plan({"layers.0.mlp.down_proj": "replicate", "*.down_proj": "rowwise", "q_proj": "colwise"})
    assert plan.style_for("model.layers.0.mlp.down_proj") == "replicate"
    assert plan.style_for("model.layers.1.mlp.down_proj") == "row"
    assert plan.style_for("model.layers.1.self_attn.q_proj") == "column"
    assert plan.style_for("model.layers.1.self_attn.xq_proj") == "replicate"  # a whole part, not a suffix


def test_fused_modules_take_their_own_entry_or_their_members_agreement() -> None:
    plan = checked_tp_plan(None)
    assert plan.fused_style("m.qkv_proj", ["m.q_proj", "m.k_proj", "m.v_proj"]) == "column"
    mixed = checked_tp_plan({"q_proj": "column", "k_proj": "row"})
    with pytest.raises(UsageError, match="different styles"):
        mixed.fused_style("m.qk", ["m.q_proj", "m.k_proj"])


@pytest.mark.parametrize("bad", [["q_proj"], {"": "column"}, {"q_proj": "sideways"}, {"q_proj": 1}])
def test_bad_plans(bad: object) -> None:
    with pytest.raises(UsageError, match=r"tp_plan|parallel style|pattern"):
        checked_tp_plan(bad)


def test_shard_layers_splits_fused_members_each(tmp_path: Path) -> None:
    folder = write_checkpoint(tmp_path / "ck", "compressed-tensors/NVFP4A16")
    plan = plan_checkpoint(folder, fuse={"qkv_proj": ["q_proj", "k_proj", "v_proj"]})
    shards, problems = shard_layers(plan, checked_tp_plan(None), 4)
    assert not problems
    qkv = shards["model.layers.0.self_attn.qkv_proj"]
    assert qkv.style == "column" and [m.shard_n for m in qkv.members] == [64, 64, 64]
    assert (qkv.n, qkv.shard_n, qkv.shard_k) == (768, 192, 256)
