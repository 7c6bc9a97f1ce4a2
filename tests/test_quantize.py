"""quantize_weight's contract: descriptor-driven output, YAML-only schemes, given scales, errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from quantize_bounds import assert_within_half_a_step, builtin_element_schemes
from torch import Tensor

from qscheme.catalog import SCHEME_PATH_VARIABLE, load_catalog, load_scheme
from qscheme.dequantize import dequantize_weight
from qscheme.errors import QuantizeError
from qscheme.quantize import quantize_weight

INT4_GROUP32_ASYMMETRIC = """
name: test/INT4_G32_ASYM_{rules}
rules: {rules}
description: int4 weights in groups of 32 along K with int4 zero points, 16-bit activations.
weight:
  format: int4
  packing: int32_k
  tensor: {{name: weight_packed, dtype: int32, shape: [N, "ceil(K/8)"]}}
  scale:
    granularity: group
    group_size: 32
    format: float
    stored: multiplier
    tensor: {{name: weight_scale, dtype: [float32, bfloat16, float16], shape: [N, "ceil(K/32)"]}}
  zero_point:
    format: int4
    packing: int32_n
    tensor: {{name: weight_zero_point, dtype: int32, shape: ["ceil(N/8)", "ceil(K/32)"]}}
  shape_tensor: {{name: weight_shape, dtype: int64, shape: [2]}}
activation: none
"""

UINT4_GROUP64_ASYMMETRIC = """
name: test/UINT4_G64_ASYM
rules: compressed-tensors
weight:
  format: uint4
  packing: nibbles_k
  tensor: {name: qweight, dtype: uint8, shape: [N, K/2]}  # no weight_shape: K must be even
  scale:
    granularity: group
    group_size: 64
    format: fp32
    stored: multiplier
    tensor: {name: scales, dtype: float32, shape: [N, "ceil(K/64)"]}
  zero_point:
    format: uint4
    packing: int32_n
    tensor: {name: zeros, dtype: int32, shape: ["ceil(N/8)", "ceil(K/64)"]}
activation: none
"""

FP8_E5M2_WEIGHT_ONLY = """
name: test/FP8_E5M2_WO_{rules}
rules: {rules}
description: FP8 e5m2 weights with one scale per output channel, 16-bit activations.
weight:
  format: e5m2
  tensor: {{name: weight, dtype: float8_e5m2, shape: [N, K]}}
  scale:
    granularity: channel
    format: float
    stored: multiplier
    tensor: {{name: weight_scale, dtype: [float32, bfloat16, float16], shape: [N, 1]}}
activation: none
"""

YAML_SCHEMES = {  # name -> file
    "test/INT4_G32_ASYM_compressed-tensors": "int4_g32_asym_compressed-tensors.yaml",
    "test/INT4_G32_ASYM_modelopt": "int4_g32_asym_modelopt.yaml",
    "test/UINT4_G64_ASYM": "uint4_g64_asym.yaml",
    "test/FP8_E5M2_WO_compressed-tensors": "fp8_e5m2_wo_compressed-tensors.yaml",
    "test/FP8_E5M2_WO_modelopt": "fp8_e5m2_wo_modelopt.yaml",
}


@pytest.fixture
def scheme_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Descriptors that exist only as YAML, in a QSCHEME_SCHEME_PATH folder."""
    for rules in ("compressed-tensors", "modelopt"):
        (tmp_path / f"int4_g32_asym_{rules}.yaml").write_text(INT4_GROUP32_ASYMMETRIC.format(rules=rules))
        (tmp_path / f"fp8_e5m2_wo_{rules}.yaml").write_text(FP8_E5M2_WEIGHT_ONLY.format(rules=rules))
    (tmp_path / "uint4_g64_asym.yaml").write_text(UINT4_GROUP64_ASYMMETRIC)
    monkeypatch.setenv(SCHEME_PATH_VARIABLE, str(tmp_path))
    return tmp_path


def test_yaml_only_schemes_are_in_the_catalog(scheme_folder: Path) -> None:
    catalog = load_catalog(include_plugins=False)
    for name in YAML_SCHEMES:
        assert name in catalog


@pytest.mark.parametrize("name", sorted(YAML_SCHEMES))
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(1, 40),
    k=st.integers(1, 200),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 1000),
    shift=st.floats(-1, 1),
)
def test_yaml_only_schemes_round_trip_within_half_a_step(
    scheme_folder: Path, name: str, n: int, k: int, dtype: torch.dtype, seed: int, shift: float
) -> None:
    generator = torch.Generator().manual_seed(seed)
    weight = ((torch.randn(n, k, generator=generator) + shift) * 0.1).to(dtype)  # asymmetric ranges too
    scheme = load_scheme(str(scheme_folder / YAML_SCHEMES[name]))  # the file itself: faster than the catalog
    if not all(spec.expected_shapes(n, k) for spec in scheme.tensor_specs().values()):
        with pytest.raises(QuantizeError, match="does not fit tensor"):
            quantize_weight(weight, scheme)
        return
    tensors = quantize_weight(weight, scheme)
    for spec in scheme.tensor_specs().values():
        if spec.name in tensors:
            assert tuple(tensors[spec.name].shape) in spec.expected_shapes(n, k), spec.name
            assert str(tensors[spec.name].dtype).removeprefix("torch.") in spec.dtypes, spec.name
    assert_within_half_a_step(scheme, weight, tensors)


@pytest.mark.parametrize("name", builtin_element_schemes())
def test_an_all_zero_block_round_trips_exactly(name: str) -> None:
    """A quarter of the weight is zero, so whole groups and blocks are: their scale may be zero
    (bitsandbytes stores absmax 0), their values must come back as zeros, and the rest within
    half a step (the check tests/test_quantize_gpu.py makes of CUDA's results)."""
    n, k = 256, 512
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(5)) * 0.05
    weight[: n // 4, : k // 4] = 0.0
    tensors = quantize_weight(weight, name)
    restored = dequantize_weight(tensors, name)
    assert torch.equal(restored[: n // 4, : k // 4], torch.zeros(n // 4, k // 4))
    assert_within_half_a_step(name, weight, tensors)


def test_asymmetric_int4_uses_the_whole_range_and_stores_zero_points_packed(scheme_folder: Path) -> None:
    weight = torch.linspace(0.0, 1.5, 64).reshape(1, 64)  # all positive: zero point at -8
    tensors = quantize_weight(weight, "test/INT4_G32_ASYM_compressed-tensors")
    assert tensors["weight_zero_point"].shape == (1, 2)
    restored = dequantize_weight(tensors, "test/INT4_G32_ASYM_compressed-tensors")
    step = tensors["weight_scale"].float().repeat_interleave(32, dim=1)
    assert bool(((restored - weight).abs() <= step / 2 + 1e-7).all())
    assert float(restored[0, 0]) == 0.0  # zero stays exactly representable


def test_the_descriptor_decides_names_dtypes_shapes_and_conventions() -> None:
    weight = torch.randn(24, 64, dtype=torch.bfloat16)
    ct = quantize_weight(weight, "compressed-tensors/NVFP4A16")
    modelopt = quantize_weight(weight, "modelopt/W4A16_NVFP4")
    assert list(ct) == ["weight_packed", "weight_scale", "weight_global_scale"]
    assert list(modelopt) == ["weight", "weight_scale", "weight_scale_2"]
    assert ct["weight_global_scale"].shape == (1,) and modelopt["weight_scale_2"].shape == ()
    # the global scale is a divisor in one and a multiplier in the other: nearly reciprocal
    assert math.isclose(float(ct["weight_global_scale"]) * float(modelopt["weight_scale_2"]), 1.0, rel_tol=1e-2)


def test_a_given_weight_scale_is_used_and_stored_as_given() -> None:
    weight = torch.randn(16, 64)
    scale = torch.full((16, 1), 0.01, dtype=torch.float32)
    tensors = quantize_weight(weight, "compressed-tensors/FP8_DYNAMIC", weight_scale=scale)
    assert torch.equal(tensors["weight_scale"], scale)
    expected = (weight / 0.01).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(tensors["weight"].view(torch.uint8), expected.view(torch.uint8))


def test_a_given_weight_scale_without_its_zero_points_is_refused() -> None:
    weight = torch.randn(16, 256)
    scale = quantize_weight(weight, "compressed-tensors/W4A16_ASYM")["weight_scale"]
    assert _error(weight, "compressed-tensors/W4A16_ASYM", weight_scale=scale) == (
        "scheme compressed-tensors/W4A16_ASYM: a given weight scale needs its zero points too; "
        "leave the scale out to have both computed"
    )


def test_quantize_accepts_a_descriptor_path_and_a_scheme_object(scheme_folder: Path) -> None:
    weight = torch.randn(8, 64)
    path = scheme_folder / "fp8_e5m2_wo_modelopt.yaml"
    by_path = quantize_weight(weight, str(path))
    by_object = quantize_weight(weight, load_scheme(str(path)))
    by_name = quantize_weight(weight, "test/FP8_E5M2_WO_modelopt")
    for name in by_name:
        assert torch.equal(by_path[name].view(torch.uint8), by_name[name].view(torch.uint8))
        assert torch.equal(by_object[name].view(torch.uint8), by_name[name].view(torch.uint8))


def _error(weight: Tensor, scheme: str, **given: Tensor) -> str:
    with pytest.raises(QuantizeError) as info:
        quantize_weight(weight, scheme, **given)
    return str(info.value)


def test_error_messages_name_the_scheme_the_tensor_and_the_fix() -> None:
    assert _error(torch.randn(4, 20), "compressed-tensors/NVFP4") == (
        "scheme compressed-tensors/NVFP4: a 4x20 weight does not fit tensor 'weight_scale', declared [N, K/16]; "
        "N and K must divide as the shape says"
    )
    message = _error(torch.randn(4, 32), "compressed-tensors/NVFP4", input_scale=torch.tensor(1.0))
    assert message == (
        "scheme compressed-tensors/NVFP4: cannot take 'input_scale'; the scales it can be given are "
        "'weight_scale', 'weight_global_scale', 'input_global_scale'"
    )
    assert _error(torch.randn(4, 32, dtype=torch.float64), "compressed-tensors/FP8") == (
        "scheme compressed-tensors/FP8: the weight is torch.float64; quantize float32, float16 or bfloat16 "
        "weights (convert with weight.float())"
    )
    assert _error(torch.randn(32), "compressed-tensors/FP8") == (
        "scheme compressed-tensors/FP8: the weight must be a non-empty 2-D [N, K] tensor, got shape (32,)"
    )
    weight = torch.randn(4, 32)
    weight[1, 3] = float("nan")
    assert _error(weight, "modelopt/FP8") == (
        "scheme modelopt/FP8: the 4x32 weight holds NaN or infinite values; quantize only finite weights"
    )
    assert "the given weight_global_scale must be finite and > 0" in _error(
        torch.randn(4, 32), "compressed-tensors/NVFP4", weight_global_scale=torch.tensor([0.0])
    )
    assert "holds e8m0 bytes (uint8)" in _error(
        torch.randn(4, 32), "compressed-tensors/MXFP4", weight_scale=torch.ones(4, 1)
    )


def test_a_meta_weight_is_refused_before_anything_reads_it() -> None:
    assert _error(torch.empty(64, 128, device="meta"), "compressed-tensors/NVFP4") == (
        "scheme compressed-tensors/NVFP4: the weight is a meta tensor, which has a shape but no values; meta "
        "tensors cannot be quantized: materialise it first (load the real weights, e.g. "
        "module.to_empty(device='cpu') then load_state_dict)"
    )


def test_a_float16_group_too_large_for_e8m0_scales_is_refused_not_written_as_nan() -> None:
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)).half()
    weight[3, 40] = 60000.0  # finite in float16; compressed-tensors' exponent overflows to the NaN byte
    assert _error(weight, "compressed-tensors/MXFP4A16") == (
        "scheme compressed-tensors/MXFP4A16: the weight_scale computed for row 3, group 1 (columns 32-63, absmax "
        "60000) is byte 0xFF (NaN), not a finite scale > 0 (1 of 256 scales); the weight is float16, and scales "
        "computed in its dtype overflow: quantize weight.float(), or use a scheme with a global scale"
    )
    tensors = quantize_weight(weight.float(), "compressed-tensors/MXFP4A16")  # the fix works
    assert bool(torch.isfinite(dequantize_weight(tensors, "compressed-tensors/MXFP4A16")).all())


def test_a_float16_range_too_wide_for_an_asymmetric_scale_is_refused_not_written_as_inf() -> None:
    weight = torch.zeros(8, 128, dtype=torch.float16)
    weight[2, 5], weight[2, 6] = -40000.0, 40000.0  # max - min overflows float16
    message = _error(weight, "compressed-tensors/W4A16_ASYM")
    assert message.startswith(
        "scheme compressed-tensors/W4A16_ASYM: the weight_scale computed for row 2, group 0 (columns 0-127, "
        "min -40000, max 40000) is inf in float16, not a finite scale > 0 (1 of 8 scales)"
    )
    assert message.endswith("quantize weight.float(), or use a scheme with a global scale")
    tensors = quantize_weight(weight.float(), "compressed-tensors/W4A16_ASYM")
    assert bool(torch.isfinite(dequantize_weight(tensors, "compressed-tensors/W4A16_ASYM")).all())


@pytest.mark.parametrize("scheme", ["compressed-tensors/MXFP4", "modelopt/mxfp4"])
def test_float32_weights_whose_scales_or_dequantized_values_overflow_are_refused(scheme: str) -> None:
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    weight = weight / weight.abs().max() * 3e38  # finite, within 12% of the float32 maximum
    message = _error(weight, scheme)
    assert "not a finite scale > 0" in message or "to infinity in float32" in message
    assert "scale the weight down" in message
    quantize_weight(weight / 4, scheme)  # a little further from the limit, it works


def test_a_scale_whose_largest_element_overflows_float32_names_the_region() -> None:
    weight = torch.full((4, 64), 1.0)
    weight[1, 40] = 3e38
    assert _error(weight, "modelopt/mxfp4") == (
        "scheme modelopt/mxfp4: the weight_scale of row 1, group 1 (columns 32-63, absmax 3e+38) dequantizes its "
        "largest element, 6 x 8.50706e+37, to infinity in float32 (1 of 8 scales); the weight's values are too "
        "close to the float32 maximum: scale the weight down"
    )


@pytest.mark.parametrize("scheme", sorted(load_catalog().schemes))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_an_all_zero_weight_gets_small_positive_scales_and_dequantizes_to_zero(scheme: str, dtype: torch.dtype) -> None:
    # both producers replace a zero scale by a small positive one: nothing here is refused
    tensors = quantize_weight(torch.zeros(64, 256, dtype=dtype), scheme)
    assert bool((dequantize_weight(tensors, scheme) == 0).all())


# --- zero points must fit their declared format -----------------------------------------------


def _zero_point_scheme(element: str, zero_format: str, zero_tensor: str, packing: str = "none") -> str:
    weight_tensor = (
        "{name: weight_packed, dtype: uint8, shape: [N, K/2]}"
        if element in ("int4", "uint4")
        else f"{{name: weight, dtype: {element}, shape: [N, K]}}"
    )
    return f"""
name: test/ZP_{element}_{zero_format}
weight:
  format: {element}
  packing: {"nibbles_k" if element in ("int4", "uint4") else "none"}
  tensor: {weight_tensor}
  scale:
    granularity: channel
    format: fp32
    stored: multiplier
    tensor: {{name: weight_scale, dtype: float32, shape: [N, 1]}}
  zero_point:
    format: {zero_format}
    packing: {packing}
    tensor: {zero_tensor}
activation: none
"""


@pytest.mark.parametrize(
    ("element", "zero_format", "zero_tensor", "packing", "holds"),
    [
        ("uint4", "int4", '{name: weight_zero_point, dtype: int32, shape: ["N/8", 1]}', "int32_n", "[-8, 7]"),
        ("uint8", "int4", "{name: weight_zero_point, dtype: int8, shape: [N, 1]}", "none", "[-8, 7]"),
        ("uint8", "int8", "{name: weight_zero_point, dtype: int8, shape: [N, 1]}", "none", "[-128, 127]"),
    ],
)
def test_a_zero_point_format_that_cannot_hold_the_zero_points_is_refused(
    element: str, zero_format: str, zero_tensor: str, packing: str, holds: str
) -> None:
    """Not a raw FormatError from the packer, nor zero points silently wrapped into the format.
    (The parser may refuse such a descriptor too; a Scheme built in code reaches quantize_weight.)"""
    from dataclasses import replace

    from qscheme.descriptor import parse_scheme_text

    valid = parse_scheme_text(_zero_point_scheme(element, element, zero_tensor, packing))
    assert valid.weight.zero_point is not None
    zero_point = replace(valid.weight.zero_point, format=zero_format)
    scheme = replace(valid, weight=replace(valid.weight, zero_point=zero_point))
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(0)) * 0.05 + 0.01
    with pytest.raises(QuantizeError) as info:
        quantize_weight(weight, scheme)
    message = str(info.value)
    assert f"zero_point format {zero_format!r} holds {holds}" in message
    assert f"zero points computed for the {element} weight lie in [" in message
    assert f"declare the zero point format {element!r}" in message


def test_uint8_zero_points_stored_in_an_int8_tensor_keep_their_bits() -> None:
    from qscheme.canonical import canonicalize, dequantize
    from qscheme.descriptor import parse_scheme_text

    scheme = parse_scheme_text(
        _zero_point_scheme("uint8", "uint8", "{name: weight_zero_point, dtype: int8, shape: [N, 1]}")
    )
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(0)) * 0.05 - 0.02  # zero points > 127
    tensors = quantize_weight(weight, scheme)
    stored = tensors["weight_zero_point"]
    assert stored.dtype == torch.int8 and int(stored.min()) < 0
    canonical = canonicalize(scheme, tensors, 48, 96)
    assert canonical.zero_point is not None and int(canonical.zero_point.max()) > 127
    assert torch.equal(canonical.zero_point.to(torch.uint8).view(torch.int8).reshape(stored.shape), stored)
    assert float((dequantize(canonical) - weight).norm() / weight.norm()) < 0.01
