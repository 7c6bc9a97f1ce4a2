"""Sharding rules from descriptors: every catalog scheme's shard, dequantized, is the slice of
the whole layer's dequantized weight; splits that cut a unit fail naming layer, sizes and degrees."""

from __future__ import annotations

import pytest
import torch
from kernel_fakes import builtin_schemes, layer_tensors

from qscheme.canonical import canonicalize, dequantize
from qscheme.descriptor import Scheme
from qscheme.parallel import ShardError, shard_layout, split_multiple, working_degrees
from qscheme.parallel.rules import checked_degree, whole_layer_tensors

N, K = 256, 512  # every built-in scheme splits these 2 ways both ways


def _shard(scheme: Scheme, tensors: dict[str, torch.Tensor], style: str, tp: int, rank: int) -> torch.Tensor:
    layout = shard_layout(scheme, N, K, style, tp, stored_shapes={k: tuple(v.shape) for k, v in tensors.items()})  # type: ignore[arg-type]
    part = {}
    for name, value in tensors.items():
        split = layout.tensors[name]
        part[name] = (
            torch.tensor([layout.shard_n, layout.shard_k])
            if split.rewrite
            else split.values(rank, value[split.index(rank)])
        )
    return dequantize(canonicalize(scheme, part, layout.shard_n, layout.shard_k))


@pytest.mark.parametrize("scheme", builtin_schemes(), ids=lambda s: s.name)
def test_every_shard_dequantizes_to_its_slice_of_the_layer(scheme: Scheme) -> None:
    tensors = layer_tensors(scheme, N, K)
    whole = dequantize(canonicalize(scheme, tensors, N, K))
    if whole_layer_tensors(scheme):  # bitsandbytes' flat codes and state: refused, saying why
        for style in ("column", "row"):
            with pytest.raises(ShardError, match=r"counted over the whole layer; qscheme does not split"):
                shard_layout(scheme, N, K, style, 2)  # type: ignore[arg-type]
        return
    for style, dim in (("column", 0), ("row", 1)):
        parts = [_shard(scheme, tensors, style, 2, rank) for rank in range(2)]
        assert torch.equal(torch.cat(parts, dim=dim), whole), f"{scheme.name} {style}"


def _scheme(name: str) -> Scheme:
    return next(s for s in builtin_schemes() if s.name == name)


def test_which_tensors_split_and_which_are_replicated() -> None:
    awq = _scheme("modelopt/W4A16_AWQ")
    row = shard_layout(awq, N, K, "row", 2)
    assert row.tensors["pre_quant_scale"].dim == 0 and row.tensors["weight"].dim == 1
    column = shard_layout(awq, N, K, "column", 2)
    assert column.tensors["pre_quant_scale"].replicated and column.tensors["weight"].shard_shape == (N // 4, K)
    nvfp4 = _scheme("compressed-tensors/NVFP4")
    row = shard_layout(nvfp4, N, K, "row", 4)
    assert row.tensors["weight_scale"].shard_shape == (N, K // 16 // 4)  # group scales split with K
    assert row.tensors["weight_global_scale"].replicated and row.tensors["input_global_scale"].replicated
    asym = _scheme("compressed-tensors/W4A16_ASYM")
    column = shard_layout(asym, N, K, "column", 2)
    assert column.tensors["weight_zero_point"].shard_shape == (N // 8 // 2, K // 128)  # packed along N
    assert column.tensors["weight_shape"].rewrite


@pytest.mark.parametrize(
    ("name", "style", "n", "k", "tp", "cut"),
    [
        (
            "compressed-tensors/NVFP4",
            "row",
            4096,
            1856,
            8,
            "K = 1856 into 232 per rank, which cuts a scale group of 16",
        ),
        ("compressed-tensors/W4A16", "row", 4096, 384, 2, "K = 384 into 192 per rank, which cuts a scale group of 128"),
        (
            "compressed-tensors/W4A16_ASYM",
            "column",
            24,
            256,
            2,
            "N = 24 into 12 per rank, which cuts a zero-point word",
        ),
        (
            "compressed-tensors/FP8_BLOCK",
            "column",
            384,
            256,
            2,
            "N = 384 into 192 per rank, which cuts a 128x128 scale block",
        ),
        ("modelopt/W4A16_AWQ", "column", 6, 256, 2, "N = 6 into 3 per rank, which cuts a packed word"),
        ("compressed-tensors/NVFP4", "column", 100, 256, 8, "tp_size 8 does not divide N = 100 evenly"),
    ],
)
def test_a_cut_names_layer_dimension_sizes_and_working_degrees(
    name: str, style: str, n: int, k: int, tp: int, cut: str
) -> None:
    scheme = _scheme(name)
    with pytest.raises(ShardError) as caught:
        shard_layout(scheme, n, k, style, tp, layer="model.layers.3.mlp.x_proj")  # type: ignore[arg-type]
    text = str(caught.value)
    assert f"layer model.layers.3.mlp.x_proj ({name}, {style}-parallel)" in text and cut in text
    problem = caught.value.problems[0]
    assert problem.working == working_degrees(problem.size, split_multiple(scheme, style))  # type: ignore[arg-type]
    assert tp not in problem.working and 1 in problem.working
    for degree in problem.working:  # the degrees it names do split
        shard_layout(scheme, n, k, style, degree)  # type: ignore[arg-type]


def test_working_degrees() -> None:
    assert working_degrees(1856, 16) == (1, 2, 4, 29, 58)
    assert working_degrees(300, 128) == (1,)  # a padded edge group: only unsplit
    assert split_multiple(_scheme("compressed-tensors/NVFP4"), "row") == 16
    assert split_multiple(_scheme("compressed-tensors/NVFP4"), "column") == 1
    assert split_multiple(_scheme("compressed-tensors/FP8_BLOCK"), "row") == 128


def test_dynamic_per_token_activations_are_noted_for_row_splits() -> None:
    layout = shard_layout(_scheme("compressed-tensors/FP8_DYNAMIC"), N, K, "row", 2)
    assert any("per-token" in note for note in layout.notes)
    assert not shard_layout(_scheme("compressed-tensors/FP8_DYNAMIC"), N, K, "column", 2).notes


def test_degree_arguments() -> None:
    assert checked_degree(4, 3) == (4, 3)
    for size, rank in ((0, 0), (2, 2), (True, 0), (2.0, 0)):
        with pytest.raises(Exception, match="tp_"):
            checked_degree(size, rank)
