"""Scales given to quantize_weight (qscheme.quantize.given): used as given when a checkpoint could
hold them, refused with a QuantizeError naming the tensor, the problem and a fix otherwise."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from qscheme.canonical import canonicalize, dequantize
from qscheme.catalog import load_catalog, load_scheme
from qscheme.descriptor import Scheme, parse_scheme_text
from qscheme.errors import QuantizeError
from qscheme.quantize import quantize_weight
from qscheme.quantize.blocks import layer_quantizer

WEIGHT = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
NAN, INF = float("nan"), float("inf")


def _error(scheme: str | Scheme, weight: Tensor = WEIGHT, **given: Tensor) -> str:
    with pytest.raises(QuantizeError) as info:
        quantize_weight(weight, scheme, **given)
    return str(info.value)


# --- weight scales ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scheme", "given", "found"),
    [
        ("compressed-tensors/FP8", {"weight_scale": torch.tensor([0.0])}, "found 0 at [0]"),
        ("compressed-tensors/FP8", {"weight_scale": torch.tensor([-0.5])}, "found -0.5 at [0]"),
        ("compressed-tensors/FP8", {"weight_scale": torch.tensor([INF])}, "found inf at [0]"),
        ("compressed-tensors/FP8", {"weight_scale": torch.tensor([NAN])}, "found nan at [0]"),
        ("compressed-tensors/W4A16", {"weight_scale": torch.full((64, 1), -0.3)}, "found -0.3 at [0, 0]"),
        ("modelopt/FP8", {"weight_scale": torch.tensor(-1.0)}, "found -1 ("),
        (
            "compressed-tensors/NVFP4A16",
            {"weight_scale": torch.full((64, 8), NAN).to(torch.float8_e4m3fn)},
            "found nan at [0, 0]",
        ),
        (
            "compressed-tensors/MXFP4A16",
            {"weight_scale": torch.full((64, 4), 0xFF, dtype=torch.uint8)},
            "found byte 0xFF (NaN) at [0, 0]",
        ),
    ],
)
def test_a_given_weight_scale_must_be_finite_and_positive(scheme: str, given: dict[str, Tensor], found: str) -> None:
    message = _error(scheme, **given)
    assert f"the given weight_scale must be finite and > 0, {found}" in message
    assert "leave weight_scale out to have it computed" in message


def test_the_first_bad_weight_scale_is_named_with_its_index_and_the_count() -> None:
    scale = torch.full((64, 1), 0.01)
    scale[5, 0] = 0.0
    scale[9, 0] = -1.0
    assert _error("compressed-tensors/W4A16", weight_scale=scale) == (
        "scheme compressed-tensors/W4A16: the given weight_scale must be finite and > 0, found 0 at [5, 0] "
        "(2 of 64 values); give the scales a checkpoint of the scheme stores, or leave weight_scale out to have "
        "it computed"
    )


def test_a_given_weight_scale_must_have_the_declared_shape_not_just_as_many_values() -> None:
    scale = quantize_weight(WEIGHT, "compressed-tensors/NVFP4A16")["weight_scale"]
    assert _error("compressed-tensors/NVFP4A16", weight_scale=scale.float().t().contiguous()) == (
        "scheme compressed-tensors/NVFP4A16: the given weight_scale has shape [8, 64]; for a 64x128 weight it "
        "must be [64, 8] (declared [N, K/16]): give the scales in the shape a checkpoint stores them"
    )
    assert "must be [64, 1]" in _error("compressed-tensors/W4A16", weight_scale=torch.full((64,), 0.01))
    assert "must be [1]" in _error("compressed-tensors/FP8", weight_scale=torch.tensor(0.01))
    weight = torch.randn(256, 256)
    message = _error("modelopt/fp8_pb_wo", weight, weight_scale=torch.full((2, 2), 0.01))
    assert "must be [2, 1, 2, 1] (declared [ceil(N/128), 1, ceil(K/128), 1] or [])" in message
    # the 0-dim form is declared for a weight of a single block only
    assert "must be [2, 1, 2, 1]" in _error("modelopt/fp8_pb_wo", weight, weight_scale=torch.tensor(0.01))


def test_every_declared_shape_of_a_weight_scale_is_taken() -> None:
    weight = torch.randn(256, 256)
    blocks = quantize_weight(weight, "modelopt/fp8_pb_wo", weight_scale=torch.full((2, 1, 2, 1), 0.01))
    assert blocks["weight_scale"].shape == (2, 1, 2, 1)
    small = torch.randn(64, 128)
    single = quantize_weight(small, "modelopt/fp8_pb_wo", weight_scale=torch.tensor(0.01))
    assert float(single["weight_scale"].reshape(())) == pytest.approx(0.01)
    for shape in [(), (1,)]:  # modelopt/FP8 declares [] or [1]
        quantize_weight(small, "modelopt/FP8", weight_scale=torch.full(shape, 0.01))


def test_a_given_weight_scale_must_have_a_float_dtype_or_e8m0_bytes() -> None:
    assert _error("compressed-tensors/W4A16", weight_scale=torch.full((64, 1), 3, dtype=torch.int32)) == (
        "scheme compressed-tensors/W4A16: the given weight_scale is torch.int32; give a float tensor "
        "(float32, bfloat16, float16) holding the scales a checkpoint stores"
    )
    assert "holds e8m0 bytes (uint8), got torch.float32" in _error(
        "compressed-tensors/MXFP4A16", weight_scale=torch.ones(64, 4)
    )


def test_a_given_weight_scale_must_survive_the_cast_to_its_stored_dtype() -> None:
    assert _error("compressed-tensors/NVFP4A16", weight_scale=torch.full((64, 8), 1e-5)) == (
        "scheme compressed-tensors/NVFP4A16: the given weight_scale holds 1e-05 at [0, 0], which becomes 0 when "
        "stored as float8_e4m3fn (512 of 512 values); give the scales a checkpoint of the scheme stores, or leave "
        "weight_scale out to have it computed"
    )
    assert "holds 1000 at [0, 0], which becomes 448 when stored as float8_e4m3fn" in _error(
        "compressed-tensors/NVFP4A16", weight_scale=torch.full((64, 8), 1000.0)
    )
    # compressed-tensors stores a float scale in the weight's dtype
    assert "holds 100000 at [0], which becomes inf when stored as float16" in _error(
        "compressed-tensors/FP8", WEIGHT.half(), weight_scale=torch.tensor([1e5])
    )


def test_a_given_scale_too_large_to_dequantize_says_so() -> None:
    message = _error("compressed-tensors/MXFP4A16", weight_scale=torch.full((64, 4), 254, dtype=torch.uint8))
    assert "dequantizes its largest element, 6 x 1.70141e+38, to infinity in float32" in message
    assert message.endswith(
        "check the given weight_scale: give the scales a checkpoint of the scheme stores, "
        "or leave it out to have it computed"
    )


def test_valid_given_e8m0_bytes_include_the_smallest_scale() -> None:
    tensors = quantize_weight(WEIGHT, "compressed-tensors/MXFP4A16", weight_scale=torch.zeros(64, 4, dtype=torch.uint8))
    assert int(tensors["weight_scale"].max()) == 0  # byte 0 is 2**-127, a valid (tiny) scale


def _given_weight_scales(scheme_name: str, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    weight = load_scheme(scheme_name).weight
    names = [weight.scale.tensor.name] + ([weight.global_scale.tensor.name] if weight.global_scale else [])
    return {name: tensors[name] for name in names}


@pytest.mark.parametrize(
    "scheme",
    [
        name
        for name in load_catalog().schemes
        # blocks, and producers that quantize whole layers (bitsandbytes), take no given scales
        if load_scheme(name).weight.zero_point is None
        and load_scheme(name).weight.blocks is None
        and layer_quantizer(load_scheme(name)) is None
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_scales_quantize_weight_writes_are_taken_back_unchanged(scheme: str, dtype: torch.dtype) -> None:
    weight = torch.randn(256, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    first = quantize_weight(weight, scheme)
    again = quantize_weight(weight, scheme, **_given_weight_scales(scheme, first))
    assert list(again) == list(first)
    for name, value in first.items():
        assert again[name].dtype == value.dtype and again[name].shape == value.shape, name
        assert torch.equal(again[name].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), name


def test_a_whole_layer_quantizer_refuses_given_scales() -> None:
    """bitsandbytes computes codes, absmax and its double quantization together: given tensors would be
    silently ignored, so they are refused, naming them."""
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(2))
    first = quantize_weight(weight, "bitsandbytes/NF4_DQ")
    with pytest.raises(
        QuantizeError, match=r"computes every tensor of a layer at once; given tensors \(weight.absmax\)"
    ):
        quantize_weight(weight, "bitsandbytes/NF4_DQ", **{"weight.absmax": first["weight.absmax"]})


# --- global scales ----------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0.0, -2.0, NAN, INF])
def test_a_given_global_scale_must_be_finite_and_positive(value: float) -> None:
    message = _error("compressed-tensors/NVFP4A16", weight_global_scale=torch.tensor([value]))
    assert "the given weight_global_scale must be finite and > 0" in message
    assert "or leave it out to have it computed" in message


def test_a_given_global_scale_must_survive_the_cast_to_float32() -> None:
    message = _error("modelopt/W4A16_NVFP4", weight_scale_2=torch.tensor(1e-50, dtype=torch.float64))
    assert "the given weight_scale_2 holds 1e-50, which becomes 0 when stored as float32" in message


# --- activation scales and the pre-quantization scale ------------------------------------------


@pytest.mark.parametrize("value", [0.0, -1.0, NAN, INF])
@pytest.mark.parametrize(
    ("scheme", "name"),
    [
        ("compressed-tensors/FP8", "input_scale"),
        ("compressed-tensors/NVFP4", "input_global_scale"),
        ("modelopt/NVFP4", "input_scale"),
        ("modelopt/W4A8_NVFP4_FP8", "input_scale"),
    ],
)
def test_a_given_activation_scale_must_be_finite_and_positive(scheme: str, name: str, value: float) -> None:
    message = _error(scheme, **{name: torch.tensor([value])})
    assert f"the given {name} must be finite and > 0, found {value:g} at [0]" in message
    assert "give the calibrated activation" in message


def test_activation_scale_messages_name_the_stored_convention() -> None:
    assert _error("compressed-tensors/NVFP4", input_global_scale=torch.tensor([0.0])) == (
        "scheme compressed-tensors/NVFP4: the given input_global_scale must be finite and > 0, found 0 at [0] "
        "(1 of 1 value); give the calibrated activation global scale a checkpoint stores (a divisor, the "
        "reciprocal of the multiplier)"
    )
    assert "(a multiplier)" in _error("modelopt/FP8", input_scale=torch.tensor(-1.0))


def test_a_given_activation_scale_must_survive_the_cast_to_its_stored_dtype() -> None:
    # compressed-tensors stores a static activation scale in the weight's dtype
    assert "holds 100000 at [0], which becomes inf when stored as float16" in _error(
        "compressed-tensors/FP8", WEIGHT.half(), input_scale=torch.tensor([1e5])
    )


@pytest.mark.parametrize("value", [0.0, -1.0, NAN, INF])
def test_a_given_pre_quant_scale_must_be_finite_and_positive(value: float) -> None:
    factors = torch.ones(128)
    factors[7] = value
    assert _error("modelopt/W4A16_AWQ", pre_quant_scale=factors) == (
        f"scheme modelopt/W4A16_AWQ: the given pre_quant_scale must be finite and > 0, found {value:g} at [7] "
        "(1 of 128 values); give the positive per-input-channel factors the weight was smoothed with (AWQ)"
    )


def test_given_activation_scales_must_hold_the_declared_number_of_values() -> None:
    assert _error("modelopt/W4A16_AWQ", pre_quant_scale=torch.ones(127)) == (
        "scheme modelopt/W4A16_AWQ: the given pre_quant_scale has shape [127]; for a 64x128 weight it must be "
        "[128] (declared [K])"
    )
    assert "must be [1]" in _error("compressed-tensors/FP8", input_scale=torch.ones(2))


def test_valid_activation_scales_are_written_in_their_declared_shape() -> None:
    scalar = quantize_weight(WEIGHT, "compressed-tensors/NVFP4", input_global_scale=torch.tensor(896.0))
    assert scalar["input_global_scale"].shape == (1,) and float(scalar["input_global_scale"]) == 896.0
    awq = quantize_weight(WEIGHT, "modelopt/W4A16_AWQ", pre_quant_scale=torch.full((128,), 0.5))
    assert awq["pre_quant_scale"].shape == (128,)


# --- meta tensors -----------------------------------------------------------------------------


def test_a_given_meta_tensor_is_refused() -> None:
    message = _error("compressed-tensors/FP8", input_scale=torch.empty(1, device="meta"))
    assert message.startswith(
        "scheme compressed-tensors/FP8: the given input_scale is a meta tensor, which has a shape but no values"
    )
    assert "materialise it first" in message
    message = _error("compressed-tensors/NVFP4A16", weight_global_scale=torch.empty(1, device="meta"))
    assert "the given weight_global_scale is a meta tensor" in message


# --- a given global scale with non-e4m3 weight scales -----------------------------------------


def _global_scheme(rules: str, scale_format: str, stored: str = "multiplier", zero_point: bool = False) -> Scheme:
    """e2m1 (int4/uint4 with zero points) group-32 weights under a declared global scale."""
    scale_dtype = {"e8m0": "uint8", "fp16": "float16", "fp32": "float32"}[scale_format]
    element = "uint4" if zero_point else "e2m1"
    zero = (
        "\n  zero_point: {format: uint4, tensor: {name: weight_zero_point, dtype: uint8, shape: [N, K/32]}}"
        if zero_point
        else ""
    )
    return parse_scheme_text(
        f"""
name: test/GLOBAL_{rules}_{scale_format}_{stored}_{element}
rules: {rules}
weight:
  format: {element}
  packing: nibbles_k
  tensor: {{name: weight_packed, dtype: uint8, shape: [N, K/2]}}
  scale:
    granularity: group
    group_size: 32
    format: {scale_format}
    stored: multiplier
    tensor: {{name: weight_scale, dtype: {scale_dtype}, shape: [N, K/32]}}
  global_scale:
    stored: {stored}
    tensor: {{name: weight_global_scale, dtype: float32, shape: [1]}}{zero}
activation: none
"""
    )


def _dequantized(scheme: Scheme, tensors: dict[str, Tensor]) -> Tensor:
    return dequantize(canonicalize(scheme, tensors, *WEIGHT.shape))


@pytest.mark.parametrize(
    ("rules", "scale_format", "zero_point"),
    [
        ("modelopt", "fp16", False),
        ("modelopt", "fp32", False),
        ("modelopt", "e8m0", False),
        ("modelopt", "fp16", True),
        ("compressed-tensors", "fp16", False),
        ("compressed-tensors", "fp16", True),
    ],
)
@pytest.mark.parametrize("stored", ["multiplier", "reciprocal"])
def test_a_given_global_scale_is_absorbed_by_the_weight_scales(
    rules: str, scale_format: str, zero_point: bool, stored: str
) -> None:
    """The written checkpoint dequantizes to the same weight whatever global scale is given: the
    weight scales are computed relative to it (ModelOpt's NVFP4 rule, applied to every format)."""
    scheme = _global_scheme(rules, scale_format, stored, zero_point)
    weight = WEIGHT * 0.05
    results = {}
    for multiplier in (1.0, 0.25, 4.0, 2.0**-20):
        value = multiplier if stored == "multiplier" else 1 / multiplier
        tensors = quantize_weight(weight, scheme, weight_global_scale=torch.tensor([value]))
        dequantized = _dequantized(scheme, tensors)
        results[multiplier] = float((dequantized - weight).norm() / weight.norm())
    assert results[1.0] < 0.15, results
    for error in results.values():
        assert error == pytest.approx(results[1.0], rel=0.05, abs=1e-3), results


def test_compressed_tensors_refuses_computing_e8m0_scales_under_a_global_scale() -> None:
    """compressed-tensors multiplies the MX exponent bytes by the global scale (calculate_qparams),
    which no checkpoint can hold: refused. Given e8m0 scales with the global scale are written."""
    scheme = _global_scheme("compressed-tensors", "e8m0")
    weight = WEIGHT * 0.05
    message = _error(scheme, weight, weight_global_scale=torch.tensor([0.25]))
    assert "compressed-tensors has no rule for e8m0 (MX) scales under a global scale" in message
    assert "remove global_scale" in message
    modelopt = quantize_weight(weight, _global_scheme("modelopt", "e8m0"), weight_global_scale=torch.tensor([0.25]))
    given = quantize_weight(
        weight, scheme, weight_scale=modelopt["weight_scale"], weight_global_scale=torch.tensor([0.25])
    )
    assert torch.equal(given["weight_scale"], modelopt["weight_scale"])
    error = float((_dequantized(scheme, given) - weight).norm() / weight.norm())
    assert error < 0.15


@pytest.mark.parametrize(
    ("scheme", "given", "found"),
    [
        ("compressed-tensors/FP8", {"input_scale": torch.tensor([3e38])}, "'input_scale' holds the multiplier 3e+38"),
        ("compressed-tensors/NVFP4", {"input_global_scale": torch.tensor([1e-37])}, "holds the divisor 1e-37"),
        ("compressed-tensors/FP8", {"input_scale": torch.tensor([1e-44])}, "'input_scale' holds the multiplier"),
    ],
    ids=["fp8-overflow", "nvfp4-global-overflow", "fp8-subnormal"],
)
def test_a_given_activation_scale_the_loader_refuses_is_refused_here_too(
    scheme: str, given: dict[str, Tensor], found: str
) -> None:
    """What quantize_weight writes must load: an activation scale whose multiplier cannot
    quantize activations gets the loader's error (canonicalize), not a checkpoint that fails later."""
    with pytest.raises(QuantizeError, match="activation scale") as info:
        quantize_weight(torch.randn(64, 128), scheme, **given)
    assert found in str(info.value)


def test_a_usable_given_activation_scale_is_written_as_given() -> None:
    tensors = quantize_weight(torch.randn(64, 128), "compressed-tensors/FP8", input_scale=torch.tensor([0.01]))
    assert float(tensors["input_scale"].reshape(-1)[0]) == pytest.approx(0.01)
    canonicalize(load_scheme("compressed-tensors/FP8"), tensors)  # and it loads
