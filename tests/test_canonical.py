"""canonical: checkpoint tensors -> CanonicalWeight, and its exact float32 dequantization."""

from __future__ import annotations

import functools
import math
import types
from pathlib import Path

import pytest
import torch
from checkpoint_cache import copy_checkpoint, ct_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_fakes import builtin_schemes
from safetensors.torch import load_file, save_file
from torch import Tensor
from triton_samples import uint8_group_scheme

from qscheme import canonical
from qscheme.canonical import (
    CanonicalWeight,
    canonicalize,
    dequantize,
    dequantize_rows,
    effective_scale,
    element_values,
)
from qscheme.catalog import load_catalog, load_scheme
from qscheme.checkpoint import load_checkpoint
from qscheme.descriptor import Scheme, parse_scheme_text
from qscheme.errors import CheckpointError, QuantizeError
from qscheme.formats import decode, pack_int32_k, pack_int32_n, unpack_fp4_k
from qscheme.quantize import quantize_weight


@functools.cache
def _builtin(name: str) -> Scheme:
    return load_scheme(name)


BUILTIN = sorted(scheme.name for scheme in load_catalog(include_plugins=False) if scheme.source == "builtin")
# schemes of scales and codes (packed blocks decode by their declaration: tests/test_formats_blocks.py)
SCALED = [name for name in BUILTIN if load_scheme(name).weight.blocks is None]


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
        for dim in spec.shapes[0] if spec.shapes else ():  # a JSON state tensor declares no shape
            if dim.variable in multiple and not dim.ceil:
                multiple[dim.variable] = math.lcm(multiple[dim.variable], dim.divisor)
    n = data.draw(st.integers(1, max(1, 200 // multiple["N"]))) * multiple["N"]
    k = data.draw(st.integers(1, max(1, 300 // multiple["K"]))) * multiple["K"]
    return n, k


@pytest.mark.parametrize("name", SCALED)
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


@pytest.mark.parametrize("name", sorted(s.name for s in builtin_schemes() if s.weight.blocks is None))
def test_dequantize_rows_are_the_rows_of_dequantize_bit_for_bit(name: str) -> None:
    from qscheme.triton.samples import random_weight

    # three fused partitions (per-partition global scales), rows not aligned to 128-row blocks
    weight = random_weight(_builtin(name), 300, 200, partitions=(100, 150, 50), seed=5)
    if weight.scheme.weight.scale.granularity in ("block", "tensor") and weight.global_scale is not None:
        weight = random_weight(_builtin(name), 300, 200, seed=5)
    whole = dequantize(weight)
    for start, stop in [(0, 300), (0, 1), (37, 130), (128, 256), (299, 300), (150, 150), (5, 299)]:
        assert torch.equal(dequantize_rows(weight, start, stop), whole[start:stop]), (name, start, stop)
    buffer = torch.full((93, 200), float("nan"))
    assert dequantize_rows(weight, 37, 130, out=buffer) is buffer and torch.equal(buffer, whole[37:130])


def test_dequantize_rows_outside_the_weight_or_a_wrong_buffer_are_refused() -> None:
    from qscheme.triton.samples import random_weight

    weight = random_weight(_builtin("compressed-tensors/NVFP4A16"), 64, 32)
    with pytest.raises(QuantizeError, match=r"rows \[10, 65\) are not within the weight's N=64 rows"):
        dequantize_rows(weight, 10, 65)
    with pytest.raises(QuantizeError, match=r"out= must be a contiguous float32 \[4, 32\] tensor"):
        dequantize_rows(weight, 0, 4, out=torch.empty(4, 32, dtype=torch.bfloat16))


def _uint8_scheme(zero_point: str, name: str = "test/UINT8_G32_ZP") -> Scheme:
    return uint8_group_scheme(name, zero_point)


UINT8_ZERO_POINTS = {
    "uint8": "{format: uint8, tensor: {name: weight_zero_point, dtype: uint8, shape: [N, 'ceil(K/32)']}}",
    "int32_n": "{format: uint8, packing: int32_n, "
    "tensor: {name: weight_zero_point, dtype: int32, shape: ['ceil(N/4)', 'ceil(K/32)']}}",
}


def _mostly_negative_rows(n: int, k: int) -> Tensor:
    """Weights whose rows lean negative (uint8 zero points above 127) or positive (below)."""
    generator = torch.Generator().manual_seed(3)
    lean = torch.where(torch.arange(n) % 2 == 0, -0.08, 0.08).reshape(n, 1)
    return torch.randn(n, k, generator=generator) * 0.05 + lean


@pytest.mark.parametrize("stored", sorted(UINT8_ZERO_POINTS))
def test_uint8_zero_points_above_127_keep_their_value(stored: str) -> None:
    from triton_samples import float64_weight

    scheme = _uint8_scheme(UINT8_ZERO_POINTS[stored])
    weight = _mostly_negative_rows(24, 64)
    tensors = quantize_weight(weight, scheme)
    exact = float64_weight(scheme, tensors, 24, 64)
    layer = canonicalize(scheme, tensors)
    assert layer.zero_point is not None and layer.zero_point.dtype == torch.int16
    assert int(layer.zero_point.max()) > 127 and int(layer.zero_point.min()) >= 0
    got = dequantize(layer)
    assert torch.allclose(got.double(), exact, rtol=1e-6, atol=0)
    assert float((got - weight).norm() / weight.norm()) < 0.01  # 8-bit accuracy, not garbage


def test_uint8_zero_points_stored_as_int8_are_read_by_their_bits() -> None:
    scheme = _uint8_scheme("{format: uint8, tensor: {name: weight_zero_point, dtype: int8, shape: [N, 'ceil(K/32)']}}")
    zero_points = torch.tensor([[0, 127], [128, 255]])
    tensors = {
        "weight": torch.full((2, 64), 200, dtype=torch.uint8),
        "weight_scale": torch.ones(2, 2),
        "weight_zero_point": zero_points.to(torch.uint8).view(torch.int8),
    }
    layer = canonicalize(scheme, tensors)
    assert layer.zero_point is not None and layer.zero_point.tolist() == zero_points.tolist()
    assert dequantize(layer)[:, ::32].tolist() == (200 - zero_points).tolist()


@pytest.mark.parametrize(
    ("fmt", "dtype", "values"),
    [("uint4", "uint8", [0, 16]), ("int4", "int8", [-9, 0]), ("uint8", "int32", [-1, 3]), ("int8", "int32", [128, 0])],
)
def test_zero_points_outside_their_format_are_refused(fmt: str, dtype: str, values: list[int]) -> None:
    four_bit = fmt.endswith("4")  # 4-bit weights are packed: eight to an int32 word along K
    if four_bit:
        weight = "packing: int32_k\n  tensor: {name: weight_packed, dtype: int32, shape: [N, K/8]}"
    else:
        weight = f"tensor: {{name: weight, dtype: {fmt}, shape: [N, K]}}"
    scheme = parse_scheme_text(
        f"""
name: test/ZP_RANGE
weight:
  format: {fmt}
  {weight}
  scale: {{granularity: channel, format: fp32, stored: multiplier,
          tensor: {{name: weight_scale, dtype: float32, shape: [N, 1]}}}}
  zero_point: {{format: {fmt}, tensor: {{name: weight_zero_point, dtype: {dtype}, shape: [N, 1]}}}}
activation: none
"""
    )
    stored = scheme.weight.tensor
    tensors = {
        stored.name: torch.zeros(2, 1 if four_bit else 8, dtype=getattr(torch, stored.dtypes[0])),
        "weight_scale": torch.ones(2, 1),
        "weight_zero_point": torch.tensor(values).reshape(2, 1).to(getattr(torch, dtype)),
    }
    with pytest.raises(QuantizeError, match=rf"zero points 'weight_zero_point' must lie in .*\({fmt}\)"):
        canonicalize(scheme, tensors)


def _int32_k_scheme(element: str, k_dim: str, shape_tensor: bool = False) -> Scheme:
    extra = "\n  shape_tensor: {name: weight_shape, dtype: int64, shape: [2]}" if shape_tensor else ""
    return parse_scheme_text(
        f"""
name: test/{element.upper()}_INT32K
weight:
  format: {element}
  packing: int32_k
  tensor: {{name: weight_packed, dtype: int32, shape: [N, "{k_dim}"]}}
  scale: {{granularity: channel, format: float, stored: multiplier,
          tensor: {{name: weight_scale, dtype: float32, shape: [N, 1]}}}}{extra}
activation: none
"""
    )


@pytest.mark.parametrize(("element", "k_dim"), [("int8", "K/4"), ("int4", "K/8")])
def test_int32_k_words_hold_32_bits_of_values_whatever_the_element_width(element: str, k_dim: str) -> None:
    scheme = _int32_k_scheme(element, k_dim)
    weight = torch.randn(24, 64)
    tensors = quantize_weight(weight, scheme)
    assert canonical.layer_shape(scheme, tensors) == (24, 64)
    layer = canonicalize(scheme, tensors)
    assert (layer.n, layer.k) == (24, 64)
    assert float((dequantize(layer) - weight).norm() / weight.norm()) < (0.01 if element.endswith("8") else 0.2)


@pytest.mark.parametrize(
    ("scheme_text", "n", "k", "message"),
    [
        (None, 24, 60, r"K may be anything in \[57, 64\]; declare a shape_tensor"),
        ("odd_nibbles", 24, 63, r"K may be anything in \[63, 64\]; declare a shape_tensor"),
        ("shape_tensor", 24, 60, r"K may be anything in \[57, 64\]; pass the scheme's 'weight_shape' tensor"),
    ],
)
def test_a_ragged_k_without_the_shape_tensor_is_refused(scheme_text: str | None, n: int, k: int, message: str) -> None:
    if scheme_text == "odd_nibbles":
        scheme = parse_scheme_text(
            """
name: test/E2M1_ODD_K
weight:
  format: e2m1
  packing: nibbles_k
  tensor: {name: weight_packed, dtype: uint8, shape: [N, "ceil(K/2)"]}
  scale: {granularity: group, group_size: 16, format: e4m3, stored: multiplier,
          tensor: {name: weight_scale, dtype: float8_e4m3fn, shape: [N, "ceil(K/16)"]}}
activation: none
"""
        )
    else:
        scheme = _int32_k_scheme("int4", "ceil(K/8)", shape_tensor=scheme_text == "shape_tensor")
    tensors = quantize_weight(torch.randn(n, k), scheme)
    tensors.pop("weight_shape", None)
    with pytest.raises(QuantizeError, match=message):
        canonical.layer_shape(scheme, tensors)
    with pytest.raises(QuantizeError, match=message):
        canonicalize(scheme, tensors)
    assert canonicalize(scheme, tensors, n, k).k == k  # a caller that knows K


def test_the_shape_tensor_or_an_exact_declaration_settles_k() -> None:
    scheme = _builtin("compressed-tensors/W4A16")  # [N, ceil(K/8)] with weight_shape
    tensors = quantize_weight(torch.randn(24, 300), scheme)
    assert canonical.layer_shape(scheme, tensors) == (24, 300)
    tensors = quantize_weight(torch.randn(24, 256), scheme)
    del tensors["weight_shape"]
    with pytest.raises(QuantizeError, match=r"K may be anything in \[249, 256\]; pass the scheme's 'weight_shape'"):
        canonical.layer_shape(scheme, tensors)
    exact = _int32_k_scheme("int4", "K/8")  # K/8 admits one K
    assert canonical.layer_shape(exact, quantize_weight(torch.randn(24, 256), exact)) == (24, 256)


@pytest.mark.parametrize("name", BUILTIN)
def test_every_builtin_scheme_solves_its_layer_shape_from_its_own_tensors(name: str) -> None:
    scheme = _builtin(name)
    tensors = quantize_weight(torch.randn(256, 512) * 0.1, scheme)
    assert canonical.layer_shape(scheme, tensors) == (256, 512)


# --- scales whose product cannot dequantize (qscheme.scale_checks) ------------------------------

E4M3_SMALLEST = 2.0**-9  # e4m3's smallest subnormal
LAYER = "model.layers.0.mlp.down_proj"


def _nvfp4(name: str, global_value: float, n: int = 4, k: int = 64, code: int = 0x22) -> dict[str, Tensor]:
    """NVFP4 tensors of ``name`` (modelopt: global multiplier, compressed-tensors: divisor) with
    every element ``code`` (0x22: 1.0, 1.0), every block scale 1 and one global value."""
    scheme = _builtin(name)
    weight_name, scale_name = scheme.weight.tensor.name, scheme.weight.scale.tensor.name
    assert scheme.weight.global_scale is not None
    global_name = scheme.weight.global_scale.tensor.name
    return {
        weight_name: torch.full((n, k // 2), code, dtype=torch.uint8),
        scale_name: torch.ones(n, k // 16).to(torch.float8_e4m3fn),
        global_name: torch.tensor([global_value]) if name.startswith("compressed") else torch.tensor(global_value),
    }


def _refusal(name: str, tensors: dict[str, Tensor]) -> str:
    with pytest.raises(QuantizeError) as info:
        canonicalize(_builtin(name), tensors, layer=LAYER)
    return str(info.value)


MODELOPT_FIX = (
    "scheme modelopt/NVFP4 reads 'weight_scale_2' as a multiplier (not a divisor): if the file stores the other "
    "convention, use a scheme that declares it; else the scales are corrupt: re-export the layer with its producer"
)


@pytest.mark.parametrize(("block_scale", "product"), [(448.0, "inf"), (64.0, "6.4e+37")])
def test_a_block_scale_whose_product_with_the_global_multiplier_overflows_is_refused(
    block_scale: float, product: str
) -> None:
    # each scale is finite: 448 (or 64) x 1e36 is inf (or 6.4e37, whose x 6 element is inf)
    tensors = _nvfp4("modelopt/NVFP4", 1e36)
    tensors["weight_scale"][1, 2] = block_scale
    assert _refusal("modelopt/NVFP4", tensors) == (
        f"layer {LAYER}, scheme modelopt/NVFP4: weight_scale[1, 2] = {block_scale:g}, times weight_scale_2 1e+36, "
        f"is {product}: the largest possible element (6) of row 1, group 2 (columns 32-47) dequantizes to infinity "
        f"in float32 (1 of 16 scales); allowed: |scale x global multiplier x 6| <= 3.40282e+38; {MODELOPT_FIX}"
    )
    tensors["weight_scale"][1, 2] = 56.0  # 56e36 x 6 = 3.36e38: finite, the largest that is
    assert bool(torch.isfinite(dequantize(canonicalize(_builtin("modelopt/NVFP4"), tensors))).all())


def test_a_product_below_the_smallest_normal_is_refused_over_nonzero_elements_only() -> None:
    tensors = _nvfp4("modelopt/NVFP4", 1.5e-38)  # normal; x e4m3's smallest scale: 2.9e-41, subnormal
    tensors["weight_scale"][0, 1] = E4M3_SMALLEST
    assert _refusal("modelopt/NVFP4", tensors) == (
        f"layer {LAYER}, scheme modelopt/NVFP4: weight_scale[0, 1] = 0.00195312, times weight_scale_2 1.5e-38, is "
        "2.92969e-41, below float32's smallest normal (1.17549e-38), but row 0, group 1 (columns 16-31) holds "
        "nonzero elements, which would dequantize to zero or to subnormals that kernels flush to zero (1 of 16 "
        f"scales); allowed: a product >= 1.17549e-38, or a zero scale over all-zero elements; {MODELOPT_FIX}"
    )
    tensors["weight"][0, 8:16] = 0  # the block's elements all zero: nothing to lose
    weight = dequantize(canonicalize(_builtin("modelopt/NVFP4"), tensors))
    assert bool(torch.isfinite(weight).all()) and bool((weight[0, 16:32] == 0).all())
    assert float(weight[0, 0]) == float(torch.tensor(1.5e-38))


def test_a_zero_block_scale_over_all_zero_elements_is_allowed() -> None:
    tensors = _nvfp4("modelopt/NVFP4", 1.0)
    tensors["weight_scale"][2, 3] = 0.0
    tensors["weight"][2, 24:32] = 0
    weight = dequantize(canonicalize(_builtin("modelopt/NVFP4"), tensors))
    assert bool((weight[2, 48:64] == 0).all()) and bool((weight[2, :48] == 1).all())


@pytest.mark.parametrize(
    ("global_value", "found"),
    [
        (1e-40, "'weight_scale_2' holds 9.99995e-41"),  # a tiny global scale x a tiny block scale: 0
        (float("inf"), "'weight_scale_2' holds inf"),
    ],
)
def test_a_global_multiplier_must_be_finite_and_normal_where_the_weight_is_not_zero(
    global_value: float, found: str
) -> None:
    assert _refusal("modelopt/NVFP4", _nvfp4("modelopt/NVFP4", global_value)) == (
        f"layer {LAYER}, scheme modelopt/NVFP4: {found} in float32 (1 of 1 value); allowed: a multiplier that is a "
        "finite, normal float32 > 0 (1.17549e-38 to 3.40282e+38), or any finite one over all-zero elements; "
        f"{MODELOPT_FIX}"
    )


def test_a_subnormal_global_multiplier_of_an_all_zero_weight_is_allowed() -> None:
    # ModelOpt writes amax / 2688 with a clamped amax for an all-zero weight: a subnormal multiplier
    tensors = quantize_weight(torch.zeros(4, 64), "modelopt/NVFP4")
    assert 0 < float(tensors["weight_scale_2"]) < torch.finfo(torch.float32).tiny
    assert bool((dequantize(canonicalize(_builtin("modelopt/NVFP4"), tensors)) == 0).all())


@pytest.mark.parametrize(
    ("divisor", "multiplier"),
    [(1e-45, "inf"), (3e38, "3.33333e-39")],  # its reciprocal overflows / is subnormal
)
def test_a_global_divisor_whose_reciprocal_is_unusable_is_refused(divisor: float, multiplier: str) -> None:
    message = _refusal("compressed-tensors/NVFP4A16", _nvfp4("compressed-tensors/NVFP4A16", divisor))
    assert message.startswith(
        f"layer {LAYER}, scheme compressed-tensors/NVFP4A16: 'weight_global_scale' holds the divisor "
        f"{float(torch.tensor(divisor)):g}, "
        f"whose reciprocal, the multiplier kernels use, is {multiplier} in float32 (1 of 1 value); allowed: a "
        "multiplier that is a finite, normal float32 > 0"
    )
    assert message.endswith(
        "scheme compressed-tensors/NVFP4A16 reads 'weight_global_scale' as a divisor (the multiplier is 1 / its "
        "value): if the file stores the other convention, use a scheme that declares it; else the scales are "
        "corrupt: re-export the layer with its producer"
    )


def test_a_divisor_product_is_checked_as_the_reference_divides_and_kernels_multiply() -> None:
    tensors = _nvfp4("compressed-tensors/NVFP4A16", 1e-36)  # multiplier 1e36
    tensors["weight_scale"][3, 0] = 448.0
    message = _refusal("compressed-tensors/NVFP4A16", tensors)
    assert "weight_scale[3, 0] = 448, times 1 / weight_global_scale 1e-36 (multiplier 1e+36), is inf" in message
    assert "of row 3, group 0 (columns 0-15) dequantizes to infinity in float32 (1 of 16 scales)" in message


@pytest.mark.parametrize(("name", "byte"), [("modelopt/FP8", 0x7F), ("compressed-tensors/FP8", 0xFF)])
def test_a_nan_fp8_weight_element_is_refused(name: str, byte: int) -> None:
    tensors = quantize_weight(torch.randn(8, 32), name)
    tensors["weight"].view(torch.uint8)[2, 5] = byte
    assert _refusal(name, tensors) == (
        f"layer {LAYER}, scheme {name}: weight 'weight' holds nan at [2, 5] (1 of 256 elements); allowed: finite "
        "e4m3 elements; the file is corrupt: re-export the layer"
    )


@pytest.mark.parametrize(
    ("byte", "expected"),
    [
        (
            254,
            "weight_scale[1, 0] = byte 0xFE (2^127), a multiplier of 1.70141e+38: the largest possible element "
            "(6) of row 1, group 0 (columns 0-31) dequantizes to infinity",
        ),
        (0, "weight_scale[1, 0] = byte 0x00 (2^-127), a multiplier of 5.87747e-39, below float32's smallest normal"),
    ],
)
def test_e8m0_scales_at_the_ends_of_their_range_are_refused_over_nonzero_elements(byte: int, expected: str) -> None:
    tensors = quantize_weight(torch.randn(4, 64), "compressed-tensors/MXFP4A16")
    tensors["weight_scale"][1, 0] = byte
    message = _refusal("compressed-tensors/MXFP4A16", tensors)
    assert f"layer {LAYER}, scheme compressed-tensors/MXFP4A16: {expected}" in message
    assert message.endswith("the scales are corrupt: re-export the layer with its producer")


def test_zero_points_widen_the_element_range_the_overflow_rule_allows_for() -> None:
    scheme = _builtin("compressed-tensors/W4A16_ASYM")
    tensors = quantize_weight(torch.randn(4, 128), scheme)
    scale = tensors["weight_scale"]
    scale[0, 0] = torch.finfo(scale.dtype).max / 10  # x 15 (code - zero point) overflows, x 8 would not
    message = _refusal("compressed-tensors/W4A16_ASYM", tensors)
    assert "the largest possible element (15) of row 0, group 0 (columns 0-127) dequantizes to infinity" in message


def test_a_static_activation_scale_whose_multiplier_is_infinite_is_refused() -> None:
    tensors = quantize_weight(torch.randn(4, 64), "compressed-tensors/NVFP4", input_global_scale=torch.tensor([1.0]))
    tensors["input_global_scale"] = torch.tensor([1e-45])  # a divisor: its reciprocal is inf
    assert _refusal("compressed-tensors/NVFP4", tensors) == (
        f"layer {LAYER}, scheme compressed-tensors/NVFP4: activation scale 'input_global_scale' holds the divisor "
        "1.4013e-45, whose reciprocal, the multiplier kernels use, is inf (1 of 1 value): the multiplier is not a "
        "finite, normal float32 > 0: kernels would quantize every activation to zero or NaN; allowed: a multiplier "
        "from 1.20371e-35 to 1.26593e+35 (normal, x 2688 finite, x 0.000976562 normal in float32); scheme "
        "compressed-tensors/NVFP4 reads 'input_global_scale' as a divisor (the multiplier is 1 / its value): if the "
        "file stores the other convention, use a scheme that declares it; else the activation calibration is corrupt: "
        "recalibrate and re-export the layer"
    )


_EXTREME_GLOBALS = [1e-45, 1e-40, 1.2e-38, 1e-30, 1e-3, 1.0, 1e3, 1e30, 1e36, 1e37, 1e38, 3.4e38]


@settings(max_examples=150, deadline=None)
@given(data=st.data())
@pytest.mark.parametrize("name", ["modelopt/NVFP4", "compressed-tensors/NVFP4A16"])
def test_what_canonicalize_accepts_dequantizes_finite_and_keeps_nonzero_elements(
    name: str, data: st.DataObject
) -> None:
    n, k = 4, 64
    scale_bytes = data.draw(st.lists(st.integers(0, 0x7E), min_size=n * k // 16, max_size=n * k // 16))
    codes = data.draw(st.lists(st.integers(0, 255), min_size=n * k // 2, max_size=n * k // 2))
    tensors = _nvfp4(name, data.draw(st.sampled_from(_EXTREME_GLOBALS)), n, k)
    scheme = _builtin(name)
    tensors[scheme.weight.scale.tensor.name] = (
        torch.tensor(scale_bytes, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(n, k // 16)
    )
    tensors[scheme.weight.tensor.name] = torch.tensor(codes, dtype=torch.uint8).reshape(n, k // 2)
    try:
        layer = canonicalize(scheme, tensors)
    except QuantizeError:
        return
    weight = dequantize(layer)
    assert bool(torch.isfinite(weight).all())
    elements = element_values(layer)
    scales = layer.scale.to(torch.float32).repeat_interleave(16, dim=1)
    assert bool((weight[(elements != 0) & (scales != 0)] != 0).all())


def test_load_checkpoint_refuses_a_global_divisor_whose_product_overflows(tmp_path: Path) -> None:
    folder = copy_checkpoint(ct_checkpoint("NVFP4A16"), tmp_path / "checkpoint")
    path = folder / "model.safetensors"
    tensors = {name: value.clone() for name, value in load_file(str(path)).items()}
    module = "model.layers.0.self_attn.k_proj"
    tensors[f"{module}.weight_global_scale"] = torch.tensor([1e-38])  # finite > 0; its multiplier is 1e38
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder)
    message = str(info.value)
    assert "nothing was loaded" in message
    assert f"model.safetensors: tensor '{module}.weight_packed': layer {module}" in message
    assert "scheme compressed-tensors/NVFP4A16: weight_scale[" in message
    assert "times 1 / weight_global_scale 1e-38 (multiplier 1e+38), is inf" in message
