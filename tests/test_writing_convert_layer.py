"""convert_layer: one layer from one scheme to another, checked against the producers' libraries.

The sources are ModelOpt's own exports (tests/fixtures/modelopt) and compressed-tensors
checkpoints written by the compressed-tensors library (checkpoint_factory). The targets are
dequantized by the other library's own float32 path (ct_reference / library_dequantize) and
compared with the source library's own dequantization (ModelOpt's, stored in the fixtures'
reference.safetensors): bit for bit where no scale was inverted, and within the reported ulps
where one was, the reported figure being exactly the largest deviation found.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoint_cache import ct_checkpoint, modelopt_fixture
from checkpoint_cache import single_threaded_torch as single_threaded_torch
from checkpoint_factory import library_dequantize, library_scheme
from ct_reference import ct_dequantize_float32
from safetensors.torch import load_file

from qscheme.catalog import load_scheme
from qscheme.checkpoint.detect import split_name
from qscheme.dequantize import dequantize_weight
from qscheme.quantize import quantize_weight
from qscheme.writing.convert_deviation import ulp_distance
from qscheme.writing.convert_layer import (
    RequantizationRefusedError,
    UnconvertibleLayerError,
    convert_layer,
)
from qscheme.writing.convert_math import compare_schemes

PAIRS = {  # fixture -> (ModelOpt scheme, compressed-tensors scheme, compressed-tensors format)
    "nvfp4": ("modelopt/NVFP4", "compressed-tensors/NVFP4", "nvfp4-pack-quantized"),
    "w4a16_nvfp4": ("modelopt/W4A16_NVFP4", "compressed-tensors/NVFP4A16", "nvfp4-pack-quantized"),
    "fp8": ("modelopt/FP8", "compressed-tensors/FP8", "float-quantized"),
}
CT_PRESET = {
    "compressed-tensors/NVFP4": "NVFP4",
    "compressed-tensors/NVFP4A16": "NVFP4A16",
    "compressed-tensors/FP8": "FP8",
    "compressed-tensors/W4A16": "W4A16",
}


def modules_of(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Quantized modules' tensors by short name (modules with a weight_scale)."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in load_file(str(path)).items():
        module, short = split_name(name)
        modules.setdefault(module, {})[short] = value
    return {module: tensors for module, tensors in modules.items() if "weight_scale" in tensors}


def ct_library_scheme(name: str, fmt: str):  # type: ignore[no-untyped-def]
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme(CT_PRESET[name], ["Linear"])
    scheme.format = fmt
    return scheme


def same_bits(a: torch.Tensor, b: torch.Tensor, *, dtype_and_shape: bool = True) -> bool:
    """Bit-identical values (and, by default, the same dtype and shape)."""
    if dtype_and_shape and (a.dtype != b.dtype or a.shape != b.shape):
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def max_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    return int(ulp_distance(a, b).max())


# --- which pairs share the math: decided from the descriptors ----------------------------------


@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("modelopt/NVFP4", "compressed-tensors/NVFP4"),
        ("modelopt/W4A16_NVFP4", "compressed-tensors/NVFP4A16"),
        ("modelopt/FP8", "compressed-tensors/FP8"),
        ("modelopt/W4A16_AWQ", "compressed-tensors/W4A16"),
        ("modelopt/mxfp4", "compressed-tensors/MXFP4"),
    ],
)
def test_pairs_sharing_the_math_both_ways(source: str, target: str) -> None:
    for a, b in ((source, target), (target, source)):
        comparison = compare_schemes(load_scheme(a), load_scheme(b))
        assert comparison.same_math, comparison.describe()


def test_nvfp4_global_scales_are_inverted_and_int4_relaid() -> None:
    nvfp4 = compare_schemes(load_scheme("modelopt/NVFP4"), load_scheme("compressed-tensors/NVFP4"))
    assert nvfp4.inverted_roles == ("weight_global_scale", "input_global_scale") and not nvfp4.relayout
    awq = compare_schemes(load_scheme("modelopt/W4A16_AWQ"), load_scheme("compressed-tensors/W4A16"))
    assert awq.inverted_roles == () and awq.relayout


@pytest.mark.parametrize(
    ("source", "target", "expected"),
    [
        ("modelopt/NVFP4", "compressed-tensors/W4A16", "weight element format: e2m1 -> int4"),
        ("compressed-tensors/NVFP4A16", "compressed-tensors/MXFP4A16", "weight group size: 16 -> 32"),
        ("compressed-tensors/W4A16", "compressed-tensors/W4A16_ASYM", "weight zero points: none -> int4"),
        ("modelopt/NVFP4", "compressed-tensors/NVFP4A16", "activation quantization: quantized -> none"),
        ("compressed-tensors/FP8", "compressed-tensors/FP8_DYNAMIC", "activation granularity: tensor -> token"),
    ],
)
def test_differences_are_named(source: str, target: str, expected: str) -> None:
    comparison = compare_schemes(load_scheme(source), load_scheme(target))
    assert not comparison.same_math
    assert expected in comparison.describe()


# --- ModelOpt exports -> compressed-tensors, checked with both libraries ------------------------


@pytest.mark.parametrize("fixture", list(PAIRS))
def test_modelopt_to_compressed_tensors_matches_both_libraries(fixture: str) -> None:
    source_name, target_name, fmt = PAIRS[fixture]
    source, target = load_scheme(source_name), load_scheme(target_name)
    folder = modelopt_fixture(fixture)
    reference = load_file(str(folder / "reference.safetensors"))  # ModelOpt's own dequantization
    library = ct_library_scheme(target_name, fmt)
    deviations = []
    for module, tensors in modules_of(folder / "model.safetensors").items():
        result = convert_layer(module, source, target, tensors)
        assert result.action == "converted"
        assert set(result.tensors) == {
            spec.name for spec in target.tensor_specs().values() if spec.name != "weight_shape"
        }
        weight_name = target.weight.tensor.name
        assert result.tensors[weight_name].data_ptr() == tensors[source.weight.tensor.name].data_ptr(), "codes touched"
        assert same_bits(result.tensors["weight_scale"], tensors["weight_scale"], dtype_and_shape=False)
        theirs = ct_dequantize_float32(result.tensors, library)
        deviation = max_ulps(theirs, reference[module])
        assert result.max_ulps == deviation, (module, result.max_ulps, deviation)
        if not result.inverted:
            assert deviation == 0
        for name in result.inverted:
            assert result.tensors[name].dtype == torch.float32 and tuple(result.tensors[name].shape) == (1,)
            assert torch.equal(result.tensors[name], torch.reciprocal(result.originals[name]).reshape(1))
        deviations.append(result.max_ulps)
        assert result.max_abs_error == float((theirs - reference[module]).abs().max())
    if fixture == "fp8":
        assert max(deviations) == 0
    else:  # block_scale * x and block_scale / fl(1/x) round apart for some layers: reported
        assert max(deviations) > 0


@pytest.mark.parametrize("fixture", list(PAIRS))
def test_converting_back_restores_the_original_tensors(fixture: str) -> None:
    source_name, target_name, _ = PAIRS[fixture]
    source, target = load_scheme(source_name), load_scheme(target_name)
    differs_without_record = 0
    for module, tensors in modules_of(modelopt_fixture(fixture) / "model.safetensors").items():
        there = convert_layer(module, source, target, tensors)
        restore = {
            source.tensor_specs()[role].name: there.originals[spec.name]
            for role, spec in target.tensor_specs().items()
            if spec.name in there.originals
        }
        back = convert_layer(module, target, source, there.tensors, restore=restore)
        assert back.max_ulps == there.max_ulps
        assert set(back.tensors) == set(tensors), module
        for name, value in tensors.items():
            assert back.tensors[name].dtype == value.dtype and back.tensors[name].shape == value.shape
            assert same_bits(back.tensors[name], value), (module, name)
        plain = convert_layer(module, target, source, there.tensors)  # no record: fl(1/fl(1/x))
        for name, value in tensors.items():
            twice = torch.reciprocal(torch.reciprocal(value.float()))
            round_trips = name not in plain.inverted or same_bits(twice.to(value.dtype), value)
            same = same_bits(plain.tensors[name], value)
            assert same == round_trips, (module, name)
            differs_without_record += not same
    if fixture == "fp8":
        assert differs_without_record == 0


def scale_that_does_not_round_trip(near: float) -> torch.Tensor:
    """The float32 value closest above ``near`` with fl(1/fl(1/x)) != x."""
    x = torch.tensor(near, dtype=torch.float32)
    while torch.equal(torch.reciprocal(torch.reciprocal(x)), x):
        x = torch.nextafter(x, torch.tensor(float("inf")))
    return x


def test_a_global_scale_whose_inverse_rounds_is_reported_and_restored() -> None:
    source, target = load_scheme("modelopt/W4A16_NVFP4"), load_scheme("compressed-tensors/NVFP4A16")
    module = "model.layers.0.self_attn.k_proj"
    tensors = dict(modules_of(modelopt_fixture("w4a16_nvfp4") / "model.safetensors")[module])
    tensors["weight_scale_2"] = scale_that_does_not_round_trip(float(tensors["weight_scale_2"]))
    there = convert_layer(module, source, target, tensors)
    library = ct_library_scheme("compressed-tensors/NVFP4A16", "nvfp4-pack-quantized")
    assert there.max_ulps == max_ulps(ct_dequantize_float32(there.tensors, library), dequantize_weight(tensors, source))
    plain = convert_layer(module, target, source, there.tensors)
    assert not torch.equal(plain.tensors["weight_scale_2"], tensors["weight_scale_2"])
    restored = convert_layer(
        module, target, source, there.tensors, restore={"weight_scale_2": there.originals["weight_global_scale"]}
    )
    assert restored.restored == ("weight_scale_2",)
    assert torch.equal(restored.tensors["weight_scale_2"], tensors["weight_scale_2"])


def test_a_stale_record_is_not_restored() -> None:
    source, target = load_scheme("modelopt/W4A16_NVFP4"), load_scheme("compressed-tensors/NVFP4A16")
    module, tensors = next(iter(modules_of(modelopt_fixture("w4a16_nvfp4") / "model.safetensors").items()))
    there = convert_layer(module, source, target, tensors)
    wrong = {"weight_scale_2": tensors["weight_scale_2"] * 2}
    back = convert_layer(module, target, source, there.tensors, restore=wrong)
    assert back.restored == ()
    assert torch.equal(
        back.tensors["weight_scale_2"], torch.reciprocal(there.tensors["weight_global_scale"]).reshape(())
    )


# --- compressed-tensors (written by the library) -> ModelOpt --------------------------------------


@pytest.mark.parametrize(("preset", "target_name"), [("NVFP4A16", "modelopt/W4A16_NVFP4"), ("FP8", "modelopt/FP8")])
def test_compressed_tensors_to_modelopt(preset: str, target_name: str) -> None:
    folder = ct_checkpoint(preset)
    source = load_scheme(f"compressed-tensors/{preset}")
    target = load_scheme(target_name)
    for module, tensors in modules_of(folder / "model.safetensors").items():
        result = convert_layer(module, source, target, tensors)
        theirs = library_dequantize(folder, module)
        ours = dequantize_weight(result.tensors, target)
        assert result.max_ulps == max_ulps(theirs, ours)
        if "weight_scale_2" in result.tensors:
            assert result.tensors["weight_scale_2"].dtype == torch.float32
            assert tuple(result.tensors["weight_scale_2"].shape) == ()
        if target_name == "modelopt/FP8":
            assert tuple(result.tensors["weight_scale"].shape) == () and result.max_ulps == 0
    assert library_scheme(folder)[0] in ("nvfp4-pack-quantized", "float-quantized")


# --- refusals ------------------------------------------------------------------------------------


def nvfp4_layer() -> tuple[str, dict[str, torch.Tensor]]:
    modules = modules_of(modelopt_fixture("nvfp4") / "model.safetensors")
    return "model.layers.0.self_attn.q_proj", modules["model.layers.0.self_attn.q_proj"]


def test_requantization_is_refused_naming_layer_schemes_and_difference() -> None:
    module, tensors = nvfp4_layer()
    with pytest.raises(RequantizationRefusedError) as caught:
        convert_layer(module, load_scheme("modelopt/NVFP4"), load_scheme("compressed-tensors/W4A16"), tensors)
    message = str(caught.value)
    for part in (module, "modelopt/NVFP4", "compressed-tensors/W4A16", "e2m1 -> int4", "allow_requantize"):
        assert part in message


def test_allowed_requantization_reports_its_error() -> None:
    module, tensors = nvfp4_layer()
    target = load_scheme("compressed-tensors/W4A16")
    result = convert_layer(module, load_scheme("modelopt/NVFP4"), target, tensors, allow_requantize=True)
    assert result.action == "requantized" and "e2m1 -> int4" in result.notes[0]
    reference = load_file(str(modelopt_fixture("nvfp4") / "reference.safetensors"))[module]
    written = dequantize_weight(result.tensors, target)
    assert result.max_abs_error == float((written - reference).abs().max()) > 0
    assert result.max_ulps == max_ulps(written, reference) > 0
    expected = quantize_weight(reference, target)
    assert set(expected) == set(result.tensors)
    assert all(torch.equal(expected[name], result.tensors[name]) for name in expected)


def test_activation_change_needs_the_flag() -> None:
    module, tensors = nvfp4_layer()
    source, target = load_scheme("modelopt/NVFP4"), load_scheme("compressed-tensors/NVFP4A16")
    with pytest.raises(RequantizationRefusedError, match="changes how inputs are quantized"):
        convert_layer(module, source, target, tensors)
    result = convert_layer(module, source, target, tensors, allow_requantize=True)
    assert result.action == "converted" and "input_global_scale" not in result.tensors
    assert any("activation quantization changes" in note for note in result.notes)


def test_missing_static_activation_scale_cannot_be_made() -> None:
    modules = modules_of(modelopt_fixture("w4a16_nvfp4") / "model.safetensors")
    module = "model.layers.0.mlp.up_proj"
    with pytest.raises(UnconvertibleLayerError, match="input_global_scale") as caught:
        convert_layer(
            module,
            load_scheme("modelopt/W4A16_NVFP4"),
            load_scheme("compressed-tensors/NVFP4"),
            modules[module],
            allow_requantize=True,
        )
    assert module in str(caught.value) and "calibration" in str(caught.value)


def test_awq_pre_scale_is_refused_then_folded_when_requantizing() -> None:
    modules = modules_of(modelopt_fixture("w4a16_awq") / "model.safetensors")
    source, target = load_scheme("modelopt/W4A16_AWQ"), load_scheme("compressed-tensors/W4A16")
    module = "model.layers.0.self_attn.o_proj"
    with pytest.raises(RequantizationRefusedError, match="pre_quant_scale"):
        convert_layer(module, source, target, modules[module])
    result = convert_layer(module, source, target, modules[module], allow_requantize=True)
    folded = dequantize_weight({k: v for k, v in modules[module].items() if k != "pre_quant_scale"}, source) * modules[
        module
    ]["pre_quant_scale"].reshape(1, -1)
    assert result.max_abs_error == float((dequantize_weight(result.tensors, target) - folded).abs().max())
    q_proj = "model.layers.0.self_attn.q_proj"
    exact = convert_layer(q_proj, source, target, modules[q_proj])
    assert exact.action == "converted" and exact.max_ulps == 0
    theirs = ct_dequantize_float32(exact.tensors, ct_library_scheme("compressed-tensors/W4A16", "pack-quantized"))
    assert torch.equal(theirs, dequantize_weight(modules[q_proj], source))


def test_unknown_source_tensor_is_named() -> None:
    module, tensors = nvfp4_layer()
    with pytest.raises(Exception, match="'bogus'"):
        convert_layer(
            module,
            load_scheme("modelopt/NVFP4"),
            load_scheme("compressed-tensors/NVFP4"),
            {**tensors, "bogus": tensors["weight_scale_2"]},
        )
