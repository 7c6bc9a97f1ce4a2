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
    assert_within_half_a_step(scheme, weight, tensors)


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
