"""The built-in descriptors against the format facts in shared/formats.md."""

from __future__ import annotations

import pytest

from qscheme.catalog import load_catalog
from qscheme.descriptor import Scheme

CATALOG = load_catalog(include_plugins=False)
N, K = 256, 512


def scheme(name: str) -> Scheme:
    return CATALOG.get(name)


def shapes(s: Scheme) -> dict[str, tuple[str, tuple[str, ...], list[tuple[int, ...]]]]:
    return {role: (spec.name, spec.dtypes, spec.expected_shapes(N, K)) for role, spec in s.tensor_specs().items()}


def test_ct_nvfp4() -> None:
    s = scheme("compressed-tensors/NVFP4")
    t = shapes(s)
    assert t["weight"] == ("weight_packed", ("uint8",), [(N, K // 2)])
    assert t["weight_scale"] == ("weight_scale", ("float8_e4m3fn",), [(N, K // 16)])
    assert t["weight_global_scale"][0] == "weight_global_scale" and t["weight_global_scale"][2] == [(1,)]
    assert t["input_global_scale"][0] == "input_global_scale"
    assert s.stored_convention("weight_global_scale") == "reciprocal"
    assert s.stored_convention("input_global_scale") == "reciprocal"
    assert s.activation is not None and s.activation.dynamic and s.activation.group_size == 16
    assert s.weight.packing == "nibbles_k" and s.weight_family == "nvfp4" and s.activation_family == "nvfp4"


def test_ct_nvfp4a16_tolerates_input_global_scale() -> None:
    s = scheme("compressed-tensors/NVFP4A16")
    assert s.activation is None and "input_global_scale" in s.tolerated


def test_modelopt_nvfp4_is_multiplier_with_same_math() -> None:
    ct, mo = scheme("compressed-tensors/NVFP4"), scheme("modelopt/NVFP4")
    assert mo.stored_convention("weight_global_scale") == "multiplier"
    assert mo.stored_convention("input_global_scale") == "multiplier"
    t = shapes(mo)
    assert t["weight"][0] == "weight" and t["weight_global_scale"][0] == "weight_scale_2"
    assert t["weight_global_scale"][2] == [(), (1,)]
    assert t["input_global_scale"][0] == "input_scale"
    assert (ct.weight.format, ct.weight.scale.format, ct.group_size) == (
        mo.weight.format,
        mo.weight.scale.format,
        mo.group_size,
    )


def test_modelopt_w4a16_nvfp4_tolerates_input_scale() -> None:
    s = scheme("modelopt/W4A16_NVFP4")
    assert s.activation is None and s.tolerated == ("input_scale",)


def test_w4a8_nvfp4_fp8_is_group_32_with_fp8_inputs() -> None:
    s = scheme("modelopt/W4A8_NVFP4_FP8")
    assert s.group_size == 32 and s.weight_family == "nvfp4" and s.activation_family == "fp8"
    assert shapes(s)["weight_scale"][2] == [(N, K // 32)]
    assert s.activation is not None and not s.activation.dynamic


@pytest.mark.parametrize(
    ("name", "weight_shape", "scale_shape"),
    [
        ("compressed-tensors/W4A16", (N, K // 8), (N, K // 128)),
        ("compressed-tensors/W4A16_ASYM", (N, K // 8), (N, K // 128)),
        ("modelopt/W4A16_AWQ", (N // 2, K), (N, K // 128)),
        ("compressed-tensors/FP8_BLOCK", (N, K), (2, 4)),
        ("compressed-tensors/FP8_DYNAMIC", (N, K), (N, 1)),
        ("compressed-tensors/W8A8", (N, K), (N, 1)),
        ("compressed-tensors/MXFP4", (N, K // 2), (N, K // 32)),
        ("modelopt/mxfp4", (N, K // 2), (N, K // 32)),
    ],
)
def test_weight_and_scale_shapes(name: str, weight_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> None:
    t = shapes(scheme(name))
    assert t["weight"][2] == [weight_shape]
    assert t["weight_scale"][2][0] == scale_shape


def test_asym_zero_points_packed_along_n() -> None:
    s = scheme("compressed-tensors/W4A16_ASYM")
    assert s.weight.zero_point is not None and s.weight.zero_point.packing == "int32_n"
    assert shapes(s)["weight_zero_point"] == ("weight_zero_point", ("int32",), [(N // 8, K // 128)])


def test_ct_int4_records_weight_shape() -> None:
    assert shapes(scheme("compressed-tensors/W4A16"))["weight_shape"] == ("weight_shape", ("int64",), [(2,)])


def test_fp8_pb_wo_block_shape_or_scalar() -> None:
    assert shapes(scheme("modelopt/fp8_pb_wo"))["weight_scale"][2] == [(2, 1, 4, 1), ()]


def test_awq_pre_quant_scale_is_optional() -> None:
    for name in ("modelopt/W4A16_AWQ", "modelopt/NVFP4_AWQ"):
        spec = scheme(name).input_pre_scale
        assert spec is not None and spec.optional and spec.name == "pre_quant_scale"


def test_every_ct_scheme_has_a_ct_rule_and_every_modelopt_one_a_quant_algo() -> None:
    for s in CATALOG:
        if s.producer == "compressed-tensors":
            assert s.detect.compressed_tensors is not None, s.name
            assert s.rules == "compressed-tensors"
        if s.producer == "modelopt":
            assert s.detect.modelopt is not None, s.name
            assert s.rules == "modelopt"


def test_mx_scales_are_e8m0_bytes() -> None:
    for name in ("compressed-tensors/MXFP4", "modelopt/mxfp4"):
        s = scheme(name)
        assert s.weight.scale.format == "e8m0" and s.weight.scale.tensor.dtypes == ("uint8",)
