"""canonical: checkpoint tensors -> CanonicalWeight, and its exact float32 dequantization."""

from __future__ import annotations

import functools
import math
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from qscheme import canonical
from qscheme.canonical import CanonicalWeight, canonicalize, dequantize, effective_scale, element_values
from qscheme.catalog import load_catalog, load_scheme
from qscheme.descriptor import Scheme, parse_scheme_text
from qscheme.formats import decode, pack_int32_k, pack_int32_n, unpack_fp4_k
from qscheme.quantize import quantize_weight


@functools.cache
def _builtin(name: str) -> Scheme:
    return load_scheme(name)


BUILTIN = sorted(scheme.name for scheme in load_catalog(include_plugins=False) if scheme.source == "builtin")


def _reference_dequantize(weight: CanonicalWeight) -> Tensor:
    """The plain formula, every scale expanded to [N, K]: (element - zero point) * scale."""
    spec = weight.scheme.weight.scale
    values = element_values(weight)
    scale = effective_scale(weight)
    n, k = weight.n, weight.k
    if spec.granularity == "group":
        tile = (1, spec.group_size or 1)
    elif spec.granularity == "block":
        tile = spec.block or (1, 1)
    else:
        tile, scale = (1, k), scale.reshape(-1, 1).expand(n, 1)

    def full(value: Tensor) -> Tensor:
        return value.repeat_interleave(tile[0], 0)[:n].repeat_interleave(tile[1], 1)[:, :k]

    if weight.zero_point is not None:
        values = values - full(weight.zero_point.to(torch.float32))
    return values * full(scale)


def _shape_for(scheme: Scheme, data: st.DataObject) -> tuple[int, int]:
    """N and K that every declared tensor's first shape divides exactly."""
    multiple = {"N": 1, "K": 1}
    for spec in scheme.tensor_specs().values():
        for dim in spec.shapes[0]:
            if dim.variable is not None and not dim.ceil:
                multiple[dim.variable] = math.lcm(multiple[dim.variable], dim.divisor)
    n = data.draw(st.integers(1, max(1, 200 // multiple["N"]))) * multiple["N"]
    k = data.draw(st.integers(1, max(1, 300 // multiple["K"]))) * multiple["K"]
    return n, k


@pytest.mark.parametrize("name", BUILTIN)
@settings(max_examples=6, deadline=None)
@given(data=st.data(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_dequantize_equals_the_plain_formula_bit_for_bit(name: str, data: st.DataObject, dtype: torch.dtype) -> None:
    scheme = _builtin(name)
    n, k = _shape_for(scheme, data)
    weight = (torch.randn(n, k, generator=torch.Generator().manual_seed(n * 1000 + k)) * 0.1).to(dtype)
    layer = canonicalize(scheme, quantize_weight(weight, scheme), n, k)
    got, expected = dequantize(layer), _reference_dequantize(layer)
    assert got.shape == (n, k) and got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


def test_fused_partitions_use_one_global_scale_per_partition() -> None:
    scheme = _builtin("compressed-tensors/NVFP4")
    parts = [torch.randn(rows, 64) * spread for rows, spread in ((16, 0.01), (8, 1.0), (24, 0.1))]
    tensors = [quantize_weight(part, scheme) for part in parts]
    fused = CanonicalWeight(
        scheme=scheme,
        n=48,
        k=64,
        codes=torch.cat([t["weight_packed"] for t in tensors]),
        scale=torch.cat([t["weight_scale"] for t in tensors]),
        global_scale=torch.cat([torch.reciprocal(t["weight_global_scale"]) for t in tensors]),
        global_scale_divisor=torch.cat([t["weight_global_scale"] for t in tensors]),
        partitions=(16, 8, 24),
    )
    separately = torch.cat([dequantize(canonicalize(scheme, t)) for t in tensors])
    assert torch.equal(dequantize(fused), separately)
    assert torch.equal(dequantize(fused), _reference_dequantize(fused))


@pytest.mark.parametrize("element", ["int4", "uint4", "int8", "uint8"])
@pytest.mark.parametrize("k", [1, 7, 8, 33, 64])
@pytest.mark.parametrize("byteorder", ["little", "big"])
def test_int32_words_unpack_to_the_element_values(
    element: str, k: int, byteorder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the little-endian fast path and the generic unpacking agree; unsigned values are stored as is
    monkeypatch.setattr(canonical, "sys", types.SimpleNamespace(byteorder=byteorder))
    bits = 4 if element.endswith("4") else 8
    low, high = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if element.startswith("int") else (0, (1 << bits) - 1)
    values = torch.randint(low, high + 1, (5, k))
    offset = 0 if element.startswith("int") else 1 << (bits - 1)
    words = pack_int32_k((values - offset).to(torch.int8), bits)
    codes = canonical._int32_k_to_codes(words, element, k)
    if bits == 4:
        assert codes.shape == (5, (k + 1) // 2)
        if k % 2:
            assert int((codes[:, -1] >> 4).max()) == 0  # the padding nibble is zero
        nibbles = unpack_fp4_k(codes, k).to(torch.int16)
        decoded = (nibbles ^ 8) - 8 if element == "int4" else nibbles
    else:
        decoded = codes.to(torch.int16)
    assert torch.equal(decoded, values.to(torch.int16))


UINT4_ASYMMETRIC = """
name: test/UINT4_ASYM
weight:
  format: uint4
  packing: int32_k
  tensor: {name: weight_packed, dtype: int32, shape: [N, "ceil(K/8)"]}
  scale: {granularity: group, group_size: 128, format: float, stored: multiplier,
          tensor: {name: weight_scale, dtype: float32, shape: [N, "ceil(K/128)"]}}
  zero_point: {format: uint4, packing: int32_n,
               tensor: {name: weight_zero_point, dtype: int32, shape: ["ceil(N/8)", "ceil(K/128)"]}}
  shape_tensor: {name: weight_shape, dtype: int64, shape: [2]}
"""


def test_unsigned_values_and_zero_points_in_int32_words_are_stored_as_they_are() -> None:
    scheme = parse_scheme_text(UINT4_ASYMMETRIC)
    zero_points = torch.randint(0, 16, (16, 2))
    values = torch.randint(0, 16, (16, 256))
    tensors = {
        "weight_packed": pack_int32_k((values - 8).to(torch.int8), 4),  # raw nibble = value
        "weight_scale": torch.ones(16, 2),
        "weight_zero_point": pack_int32_n((zero_points - 8).to(torch.int8), 4),
        "weight_shape": torch.tensor([16, 256]),
    }
    layer = canonicalize(scheme, tensors)
    assert layer.zero_point is not None and torch.equal(layer.zero_point.to(torch.int64), zero_points)
    assert torch.equal(element_values(layer), values.float())
    expected = (values - zero_points.repeat_interleave(128, dim=1)).float()
    assert torch.equal(dequantize(layer), expected)


def test_e2m1_negative_zero_decodes_to_positive_zero() -> None:
    layer = canonicalize(
        _builtin("modelopt/NVFP4"),
        {
            "weight": torch.tensor([[0x88, 0x18]], dtype=torch.uint8),
            "weight_scale": torch.ones(1, 1).to(torch.float8_e4m3fn),
            "weight_scale_2": torch.tensor(1.0),
        },
        1,
        4,
    )
    values = element_values(layer)
    assert values[0].tolist() == [0.0, 0.0, 0.0, 0.5] and not bool(torch.signbit(values).any())
    assert torch.equal(values, decode(torch.tensor([8, 8, 8, 1], dtype=torch.uint8), "e2m1").reshape(1, 4))


def test_dequantize_does_not_depend_on_the_number_of_threads() -> None:
    scheme = _builtin("compressed-tensors/W4A16_ASYM")
    weight = torch.randn(300, 512, dtype=torch.bfloat16)
    layer = canonicalize(scheme, quantize_weight(weight, scheme))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = dequantize(layer)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, dequantize(layer))
