"""dequantize_weight: checkpoint tensors -> float32 [N, K], the canonical reference path."""

from __future__ import annotations

import functools

import pytest
import torch
from quantize_bounds import assert_within_half_a_step

from qscheme.canonical import canonicalize, dequantize
from qscheme.catalog import builtin_scheme_dir, load_catalog, load_scheme
from qscheme.dequantize import dequantize_weight
from qscheme.descriptor import Scheme
from qscheme.errors import QuantizeError
from qscheme.modules import QuantLinear
from qscheme.quantize import quantize_weight

BUILTIN = sorted(scheme.name for scheme in load_catalog(include_plugins=False) if scheme.source == "builtin")


@functools.cache
def _builtin(name: str) -> Scheme:
    return load_scheme(name)


@pytest.mark.parametrize("name", BUILTIN)
def test_dequantize_weight_is_the_canonical_dequantization(name: str) -> None:
    scheme = _builtin(name)
    weight = torch.randn(64, 256, dtype=torch.bfloat16)
    tensors = quantize_weight(weight, scheme)
    result = dequantize_weight(tensors, scheme)
    assert result.dtype == torch.float32 and result.shape == (64, 256)
    assert torch.equal(result, dequantize(canonicalize(scheme, tensors)))
    if scheme.weight.blocks is None:
        assert_within_half_a_step(scheme, weight, tensors)
    else:  # llama.cpp's searches are not round-to-nearest on one scale (their bits: tests/test_gguf_quants.py)
        error = torch.linalg.vector_norm(result - weight.float()) / torch.linalg.vector_norm(weight.float())
        assert float(error) < 0.35, (name, float(error))  # Q2_K: 0.30 on normal weights


def test_a_scheme_is_named_given_or_read_from_its_file() -> None:
    tensors = quantize_weight(torch.randn(8, 32), "compressed-tensors/NVFP4A16")
    by_name = dequantize_weight(tensors, "compressed-tensors/NVFP4A16")
    by_object = dequantize_weight(tensors, _builtin("compressed-tensors/NVFP4A16"))
    by_path = dequantize_weight(tensors, builtin_scheme_dir() / "compressed-tensors" / "NVFP4A16.yaml")
    assert torch.equal(by_name, by_object) and torch.equal(by_name, by_path)


def test_incomplete_groups_round_trip_where_the_descriptor_allows_them() -> None:
    # W4A16 declares [N, ceil(K/128)] scales: the last group of 72 columns is zero-padded
    scheme = _builtin("compressed-tensors/W4A16")
    weight = torch.randn(24, 200)
    tensors = quantize_weight(weight, scheme)
    assert tensors["weight_scale"].shape == (24, 2) and tensors["weight_packed"].shape == (24, 25)
    assert tensors["weight_shape"].tolist() == [24, 200]
    assert_within_half_a_step(scheme, weight, tensors)


def test_missing_tensors_are_named() -> None:
    tensors = quantize_weight(torch.randn(4, 32), "compressed-tensors/NVFP4")
    del tensors["weight_global_scale"]
    with pytest.raises(QuantizeError) as info:
        dequantize_weight(tensors, "compressed-tensors/NVFP4")
    message = str(info.value)
    assert message.startswith("scheme compressed-tensors/NVFP4: 1 problem(s) with the given tensors:\n")
    assert "tensor 'weight_global_scale': missing: scheme compressed-tensors/NVFP4 declares" in message


@pytest.mark.parametrize("name", ["compressed-tensors/NVFP4", "compressed-tensors/W4A16_ASYM", "modelopt/fp8_pb_wo"])
def test_results_do_not_depend_on_the_number_of_threads(name: str) -> None:
    scheme = _builtin(name)
    weight = torch.randn(300, 512, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = quantize_weight(weight, scheme)
        single_weight = dequantize_weight(single, scheme)
    finally:
        torch.set_num_threads(threads)
    several = quantize_weight(weight, scheme)
    for tensor_name, value in single.items():
        assert torch.equal(value.view(torch.uint8), several[tensor_name].view(torch.uint8)), tensor_name
    assert torch.equal(single_weight, dequantize_weight(several, scheme))


def _nvfp4a16(divisor: float, block_scale: float = 1.0) -> dict[str, torch.Tensor]:
    """compressed-tensors NVFP4A16 tensors: every element 1.0, block scales 1 but [0, 0], one global divisor."""
    scale = torch.ones(4, 4)
    scale[0, 0] = block_scale
    return {
        "weight_packed": torch.full((4, 32), 0x22, dtype=torch.uint8),
        "weight_scale": scale.to(torch.float8_e4m3fn),
        "weight_global_scale": torch.tensor([divisor]),
    }


def _from_tensors(tensors: dict[str, torch.Tensor], scheme: str) -> object:
    return QuantLinear.from_tensors(scheme, tensors, layer_name="model.layers.1.mlp.up_proj")


# The three cases: each stored value is finite and passes the loader's per-tensor checks.
PRODUCT_CASES = [
    pytest.param(_nvfp4a16(1e-36, 448.0), "weight_scale[0, 0] = 448, times 1 / weight_global_scale", id="overflow"),
    pytest.param(_nvfp4a16(1e-45), "whose reciprocal, the multiplier kernels use, is inf", id="reciprocal-inf"),
    pytest.param(_nvfp4a16(3e38), "whose reciprocal, the multiplier kernels use, is 3.33333e-39", id="underflow"),
]


@pytest.mark.parametrize("entry", [dequantize_weight, _from_tensors], ids=["dequantize_weight", "from_tensors"])
@pytest.mark.parametrize(("tensors", "expected"), PRODUCT_CASES)
def test_scales_whose_product_cannot_dequantize_are_refused(entry, tensors, expected: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(QuantizeError, match="compressed-tensors/NVFP4A16") as info:
        entry(tensors, "compressed-tensors/NVFP4A16")
    assert expected in str(info.value)
    # from_tensors names its layer; dequantize_weight has none to name
    assert ("model.layers.1.mlp.up_proj" in str(info.value)) == (entry is _from_tensors)


def test_scales_far_from_the_limits_still_dequantize() -> None:
    weight = dequantize_weight(_nvfp4a16(1e-30, 448.0), "compressed-tensors/NVFP4A16")
    assert float(weight[0, 0]) == float(torch.tensor(448.0) / torch.tensor(1e-30))
    assert bool(torch.isfinite(weight).all())
