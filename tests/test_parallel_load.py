"""load_checkpoint_tp in one process: every rank's shard layers, put back together, are the layer.

Column-parallel shards' outputs concatenated, and row-parallel shards' outputs (each on its
slice of the input) summed, must equal the unsharded layer that ``load_checkpoint`` builds, for
NVFP4 weight-only and W4A4, int4 W4A16 with zero points, FP8 128x128 blocks, ModelOpt int4 AWQ
with pre-quant scales, and fused q/k/v with different global scales. Row sums differ from the
unsharded layer only by float32 summation order.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoint_cache import single_threaded_torch  # noqa: F401  (autouse)
from parallel_checkpoints import HIDDEN, LLAMA, write_checkpoint

from qscheme import load_checkpoint
from qscheme.checkpoint.load import Checkpoint
from qscheme.errors import CheckpointError, UsageError
from qscheme.parallel import ShardError, load_checkpoint_tp

FUSE = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
CASES = {
    "nvfp4_w4a16": ("compressed-tensors/NVFP4A16", (2, 4)),
    "nvfp4_w4a4": ("compressed-tensors/NVFP4", (2,)),
    "int4_zero_points": ("compressed-tensors/W4A16_ASYM", (2,)),
    "fp8_block": ("compressed-tensors/FP8_BLOCK", (2,)),
    "modelopt_int4_awq": ("modelopt/W4A16_AWQ", (2,)),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    return {case: write_checkpoint(root / case, scheme, bias=True) for case, (scheme, _) in CASES.items()}


def assembled(shards: list[Checkpoint], name: str, style: str, x: torch.Tensor) -> torch.Tensor:
    """What the ranks compute together: gathered columns, all-reduced rows, or one replica.

    A fused layer's rank holds its slice of every partition ([q_r, k_r, v_r]): gathering puts
    each partition's slices together."""
    if style == "column":
        outputs = [shard[name](x) for shard in shards]
        partitions = shards[0][name].weight_canonical.partitions or (outputs[0].shape[-1],)
        pieces = [out.split(list(partitions), dim=-1) for out in outputs]
        return torch.cat([piece[p] for p in range(len(partitions)) for piece in pieces], dim=-1)
    if style == "row":
        k = x.shape[-1] // len(shards)
        return torch.stack([shard[name](x[..., r * k : (r + 1) * k]) for r, shard in enumerate(shards)]).sum(0)
    return shards[0][name](x)


def check_equal(folder: Path, tp_size: int, **kwargs: object) -> dict[str, str]:
    full = load_checkpoint(folder, activation_dtype="float32", **kwargs)  # type: ignore[arg-type]
    shards = [
        load_checkpoint_tp(folder, rank, tp_size, activation_dtype="float32", **kwargs)  # type: ignore[arg-type]
        for rank in range(tp_size)
    ]
    generator = torch.Generator().manual_seed(7)
    styles = {}
    for name, layer in full.items():
        style = shards[0].style(name)
        styles[name] = style
        x = torch.randn(3, layer.in_features, generator=generator)
        expected = layer(x)
        got = assembled(shards, name, style, x)  # type: ignore[arg-type]
        scale = float(expected.abs().max())
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * scale, msg=f"{name} ({style}) at tp {tp_size}")
        for shard in shards:
            assert shard[name].in_features == (layer.in_features // tp_size if style == "row" else layer.in_features)
            assert shard[name].out_features == (
                layer.out_features // tp_size if style == "column" else layer.out_features
            )
    return styles


@pytest.mark.parametrize("case", list(CASES))
def test_shards_recombine_to_the_unsharded_layer(case: str, folders: dict[str, Path]) -> None:
    for tp_size in CASES[case][1]:
        styles = check_equal(folders[case], tp_size)
        assert styles["model.layers.0.self_attn.q_proj"] == "column"
        assert styles["model.layers.0.mlp.down_proj"] == "row"


def test_fused_qkv_with_different_global_scales(folders: dict[str, Path]) -> None:
    folder = folders["nvfp4_w4a16"]
    full = load_checkpoint(folder)
    scales = {m: float(full.canonical(f"model.layers.0.self_attn.{m}").global_scale) for m in ("q_proj", "k_proj")}
    assert scales["q_proj"] != scales["k_proj"]  # the case: partitions with their own global scale
    check_equal(folder, 2, fuse=FUSE)
    rank1 = load_checkpoint_tp(folder, 1, 2, fuse=FUSE)
    fused = rank1.canonical("model.layers.0.self_attn.qkv_proj")
    assert fused.partitions == (HIDDEN // 2,) * 3  # each member split on its own: q, k, v rows stay together
    fused_full = load_checkpoint(folder, fuse=FUSE).canonical("model.layers.0.self_attn.qkv_proj")
    torch.testing.assert_close(fused.global_scale, fused_full.global_scale)  # per-partition, replicated


def test_a_row_parallel_bias_is_added_once(folders: dict[str, Path]) -> None:
    folder = folders["int4_zero_points"]
    rank0, rank1 = (load_checkpoint_tp(folder, r, 2) for r in range(2))
    name = "model.layers.0.self_attn.o_proj"
    assert rank0[name].bias is not None and rank1[name].bias is None
    q0, q1 = rank0["model.layers.0.self_attn.q_proj"].bias, rank1["model.layers.0.self_attn.q_proj"].bias
    full = load_checkpoint(folder)["model.layers.0.self_attn.q_proj"].bias
    assert q0 is not None and q1 is not None and full is not None
    torch.testing.assert_close(torch.cat([q0, q1]), full)


def test_the_pre_quant_scale_splits_with_k(folders: dict[str, Path]) -> None:
    folder = folders["modelopt_int4_awq"]
    full = load_checkpoint(folder).canonical("model.layers.0.mlp.down_proj").input_pre_scale
    parts = [load_checkpoint_tp(folder, r, 2).canonical("model.layers.0.mlp.down_proj").input_pre_scale for r in (0, 1)]
    assert full is not None and all(p is not None for p in parts)
    torch.testing.assert_close(torch.cat(parts), full)  # type: ignore[arg-type]


def test_a_custom_plan_replicates_a_layer(folders: dict[str, Path]) -> None:
    folder = folders["nvfp4_w4a4"]
    plan = {"down_proj": "replicate", "q_proj": "colwise", "o_proj": "rowwise"}
    shard = load_checkpoint_tp(folder, 1, 2, tp_plan=plan)
    assert shard.style("model.layers.0.mlp.down_proj") == "replicate"
    assert shard.style("model.layers.0.mlp.up_proj") == "replicate"  # a plan replaces the default
    assert shard["model.layers.0.mlp.down_proj"].in_features == 512
    assert shard.style("model.layers.0.self_attn.q_proj") == "column"


def test_a_split_that_cuts_a_block_fails_naming_layer_sizes_and_degrees(tmp_path: Path) -> None:
    shapes = {**LLAMA, "self_attn.k_proj": (128, HIDDEN)}  # N = 128: one FP8 block, no split
    folder = write_checkpoint(tmp_path / "fp8", "compressed-tensors/FP8_BLOCK", shapes)
    with pytest.raises(ShardError) as caught:
        load_checkpoint_tp(folder, 0, 2)
    message = str(caught.value)
    assert "layer model.layers.0.self_attn.k_proj (compressed-tensors/FP8_BLOCK, column-parallel)" in message
    assert "splits N = 128 into 64 per rank, which cuts a 128x128 scale block" in message
    assert "N = 128 splits whole only at tp_size 1" in message
    assert isinstance(caught.value, CheckpointError)
    assert [p.layer for p in caught.value.problems] == ["model.layers.0.self_attn.k_proj"]


def test_bad_arguments_are_usage_errors(folders: dict[str, Path]) -> None:
    folder = folders["nvfp4_w4a4"]
    for rank, size in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(UsageError, match="tp_"):
            load_checkpoint_tp(folder, rank, size)
    with pytest.raises(UsageError, match="not a parallel style"):
        load_checkpoint_tp(folder, 0, 2, tp_plan={"q_proj": "diagonal"})
    with pytest.raises(UsageError, match="tp_plan must map"):
        load_checkpoint_tp(folder, 0, 2, tp_plan=["q_proj"])


def test_load_checkpoint_delegates_to_the_rank_loader(folders: dict[str, Path]) -> None:
    """``load_checkpoint(path, tp_rank=, tp_size=)`` is ``load_checkpoint_tp``; a degree without
    a rank (and no process group) is a UsageError, not rank 0 on every process."""
    from qscheme.parallel import ShardedCheckpoint

    folder = folders["nvfp4_w4a16"]
    whole = load_checkpoint(folder)
    shard = load_checkpoint(folder, tp_rank=1, tp_size=2)
    assert isinstance(shard, ShardedCheckpoint) and shard.tp_rank == 1
    name = next(n for n in whole if n.endswith("q_proj"))
    assert shard[name].out_features * 2 == whole[name].out_features
    with pytest.raises(UsageError, match="needs tp_rank"):
        load_checkpoint(folder, tp_size=2)


def test_a_projection_stored_fused_is_not_cut_into_contiguous_runs(tmp_path: Path) -> None:
    """A checkpoint storing qkv_proj already fused (q 256 + k 64 + v 64 rows): a contiguous split
    would give rank 0 only q rows, so it is refused, naming the layer; replicated, it loads."""
    folder = write_checkpoint(tmp_path / "fused", "compressed-tensors/W4A16", {"self_attn.qkv_proj": (384, 256)})
    with pytest.raises(ShardError, match=r"model\.layers\.0\.self_attn\.qkv_proj.*already fused") as caught:
        load_checkpoint_tp(folder, 0, 2)
    assert "replicate" in str(caught.value)
    replicated = load_checkpoint_tp(folder, 0, 2, {"qkv_proj": "replicate"})
    assert replicated["model.layers.0.self_attn.qkv_proj"].out_features == 384
