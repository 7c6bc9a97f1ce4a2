"""Detection (checkpoint.detect, the producers' detect): module -> scheme from the descriptors' rules."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from checkpoint_cache import (
    ct_checkpoint,
    modelopt_fixture,
    single_threaded_torch,  # noqa: F401  (autouse)
)
from checkpoint_factory import CT_PRESETS

from qscheme.catalog import load_catalog
from qscheme.checkpoint.config import NoQuantization, read_producer_config
from qscheme.checkpoint.detect import detect
from qscheme.checkpoint.patterns import MAX_NAME_LENGTH
from qscheme.errors import CheckpointError
from qscheme.producers.compressed_tensors.config import CompressedTensorsConfig, ConfigGroup
from qscheme.producers.compressed_tensors.detect import normalize_arguments
from qscheme.producers.modelopt.config import MixedPrecisionLayer, ModeloptConfig
from qscheme.storage import CheckpointFiles, TensorInfo

SCHEMES = list(load_catalog())
NVFP4_WEIGHTS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True}
FP8_INPUTS = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def _nvfp4_module(prefix: str, n: int = 64, k: int = 128, inputs: bool = False) -> dict[str, TensorInfo]:
    file = Path("model.safetensors")
    tensors = {
        f"{prefix}.weight_packed": TensorInfo(f"{prefix}.weight_packed", "uint8", (n, k // 2), file),
        f"{prefix}.weight_scale": TensorInfo(f"{prefix}.weight_scale", "float8_e4m3fn", (n, k // 16), file),
        f"{prefix}.weight_global_scale": TensorInfo(f"{prefix}.weight_global_scale", "float32", (1,), file),
    }
    if inputs:
        tensors[f"{prefix}.input_global_scale"] = TensorInfo(f"{prefix}.input_global_scale", "float32", (1,), file)
    return tensors


def _plain(name: str, shape: tuple[int, ...]) -> dict[str, TensorInfo]:
    return {name: TensorInfo(name, "float32", shape, Path("model.safetensors"))}


def _ct(groups: list[ConfigGroup], ignore: tuple[str, ...] = ()) -> CompressedTensorsConfig:
    return CompressedTensorsConfig(
        file="config.json",
        groups=tuple(groups),
        ignore=ignore,
        format="nvfp4-pack-quantized",
        version="0.20.1",
        quantization_status="compressed",
        kv_cache_scheme=None,
    )


@pytest.mark.parametrize("preset", CT_PRESETS)
def test_every_builtin_compressed_tensors_preset_is_detected(preset: str) -> None:
    folder = ct_checkpoint(preset)
    detection = detect(read_producer_config(folder), CheckpointFiles(folder).tensors, SCHEMES)
    assert detection.scheme_counts() == {f"compressed-tensors/{preset}": 7}
    assert detection.ignored == {"lm_head": "lm_head"}
    assert "model.embed_tokens.weight" in detection.plain
    assert (
        detection.modules["model.layers.0.self_attn.q_proj"].origin
        == "quantization_config.config_groups.group_0 (target 'Linear')"
    )


@pytest.mark.parametrize(
    ("fixture", "scheme"),
    [
        ("nvfp4", "modelopt/NVFP4"),
        ("w4a16_nvfp4", "modelopt/W4A16_NVFP4"),
        ("fp8", "modelopt/FP8"),
        ("w4a16_awq", "modelopt/W4A16_AWQ"),
        ("w4a8_nvfp4_fp8", "modelopt/W4A8_NVFP4_FP8"),
        ("fp8_pb_wo", "modelopt/fp8_pb_wo"),
        ("mxfp4", "modelopt/mxfp4"),
    ],
)
def test_modelopt_fixtures_are_detected(fixture: str, scheme: str) -> None:
    folder = modelopt_fixture(fixture)
    detection = detect(read_producer_config(folder), CheckpointFiles(folder).tensors, SCHEMES)
    assert detection.scheme_counts() == {scheme: 7}
    assert set(detection.ignored) == {"lm_head", "model.embed_tokens"}


def test_modelopt_exclude_modules_are_fnmatch_wildcards() -> None:
    folder = modelopt_fixture("nvfp4_exclude")
    detection = detect(read_producer_config(folder), CheckpointFiles(folder).tensors, SCHEMES)
    assert detection.scheme_counts() == {"modelopt/NVFP4": 6}
    assert detection.ignored["model.layers.0.mlp.down_proj"] == "model.layers.0.mlp.down_proj"
    assert detection.ignored["model.layers.1.self_attn.q_proj"] == "model.layers.1*"
    assert "model.layers.1.mlp.up_proj.weight" in detection.plain


def test_nvfp4_weights_with_fp8_inputs_match_no_scheme_and_list_the_nearest() -> None:
    group = ConfigGroup("group_0", ("Linear",), NVFP4_WEIGHTS, FP8_INPUTS, None, "nvfp4-pack-quantized")
    tensors = _nvfp4_module("model.layers.0.self_attn.q_proj", inputs=True)
    with pytest.raises(CheckpointError) as caught:
        detect(_ct([group]), tensors, SCHEMES)
    message = str(caught.value)
    assert "module model.layers.0.self_attn.q_proj (quantization_config.config_groups.group_0" in message
    assert 'no scheme matches weights {num_bits: 4, type: "float", strategy: "tensor_group", group_size: 16' in message
    assert 'input_activations {num_bits: 8, type: "float", strategy: "tensor", dynamic: false' in message
    nearest = message.split("Nearest schemes: ")[1]
    assert nearest.startswith("compressed-tensors/NVFP4A16 (input_activations present but the scheme has none); ")
    assert "compressed-tensors/NVFP4 (input_activations.num_bits is 8, scheme has 4, " in nearest


def test_argument_forms_019_and_020_normalise_alike() -> None:
    v019 = {**NVFP4_WEIGHTS, "actorder": None, "block_structure": None, "zp_dtype": None, "observer_kwargs": {}}
    v020 = {**NVFP4_WEIGHTS, "scale_dtype": "torch.float8_e4m3fn", "observer": "memoryless_minmax"}
    normalized_019, normalized_020 = normalize_arguments(v019), normalize_arguments(v020)
    assert normalized_019 is not None and normalized_020 is not None
    normalized_020.pop("scale_dtype")
    assert normalized_019 == normalized_020
    assert normalize_arguments({"dynamic": "local"}) == normalize_arguments({"dynamic": True})
    assert normalize_arguments({"group_size": 128})["strategy"] == "group"  # type: ignore[index]
    assert normalize_arguments({"block_structure": "128x128"})["block_structure"] == [128, 128]  # type: ignore[index]


def test_regex_targets_win_over_class_targets_and_ignore_applies() -> None:
    fp8 = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
    dynamic = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    groups = [
        ConfigGroup("group_0", ("Linear",), NVFP4_WEIGHTS, None, None, "nvfp4-pack-quantized"),
        ConfigGroup("group_1", ("re:.*mlp.down_proj$",), fp8, dynamic, None, "float-quantized"),
    ]
    file = Path("model.safetensors")
    down = "model.layers.0.mlp.down_proj"
    tensors = {
        **_nvfp4_module("model.layers.0.self_attn.q_proj"),
        f"{down}.weight": TensorInfo(f"{down}.weight", "float8_e4m3fn", (64, 128), file),
        f"{down}.weight_scale": TensorInfo(f"{down}.weight_scale", "float32", (64, 1), file),
        **_plain("lm_head.weight", (256, 64)),
        **_plain("model.norm.weight", (64,)),
    }
    detection = detect(_ct(groups, ignore=("re:^lm_head$",)), tensors, SCHEMES)
    assert detection.modules[down].scheme.name == "compressed-tensors/FP8_DYNAMIC"
    assert detection.modules[down].origin.endswith("(target 're:.*mlp.down_proj$')")
    assert detection.modules["model.layers.0.self_attn.q_proj"].scheme.name == "compressed-tensors/NVFP4A16"
    assert detection.ignored == {"lm_head": "re:^lm_head$"}
    assert detection.plain == ("lm_head.weight", "model.norm.weight")


def test_quantized_tensors_under_an_ignored_module_are_an_error() -> None:
    group = ConfigGroup("group_0", ("Linear",), NVFP4_WEIGHTS, None, None, "nvfp4-pack-quantized")
    with pytest.raises(
        CheckpointError, match=r"module lm_head is in quantization_config.ignore \('lm_head'\) but stores"
    ):
        detect(_ct([group], ignore=("lm_head",)), _nvfp4_module("lm_head"), SCHEMES)


def test_quantized_module_no_group_targets_is_an_error() -> None:
    group = ConfigGroup("group_0", ("re:.*q_proj$",), NVFP4_WEIGHTS, None, None, "nvfp4-pack-quantized")
    tensors = {**_nvfp4_module("model.q_proj"), **_nvfp4_module("model.k_proj")}
    with pytest.raises(
        CheckpointError, match=r"module model\.k_proj stores quantized tensors .* but no config group targets it"
    ):
        detect(_ct([group]), tensors, SCHEMES)


def test_equally_specific_groups_are_ambiguous() -> None:
    groups = [
        ConfigGroup("group_0", ("Linear",), NVFP4_WEIGHTS, None, None, "nvfp4-pack-quantized"),
        ConfigGroup("group_1", ("Linear",), NVFP4_WEIGHTS, None, None, "nvfp4-pack-quantized"),
    ]
    with pytest.raises(CheckpointError, match="targeted equally by config groups group_0, group_1"):
        detect(_ct(groups), _nvfp4_module("model.q_proj"), SCHEMES)


def _modelopt(**kwargs: object) -> ModeloptConfig:
    base: dict[str, object] = {
        "file": "hf_quant_config.json",
        "quant_algo": "NVFP4",
        "group_size": 16,
        "exclude_modules": (),
        "kv_cache_quant_algo": None,
    }
    return ModeloptConfig(**{**base, **kwargs})  # type: ignore[arg-type]


def test_unknown_quant_algo_names_the_known_ones() -> None:
    with pytest.raises(CheckpointError) as caught:
        detect(_modelopt(quant_algo="NVFP5"), _nvfp4_module("model.q_proj"), SCHEMES)
    message = str(caught.value)
    assert "quant_algo 'NVFP5' is not known to any scheme. Did you mean NVFP4" in message
    assert "W4A16_AWQ" in message


def test_lower_case_quant_algo_matches() -> None:
    file = Path("model.safetensors")
    tensors = {
        "m.weight": TensorInfo("m.weight", "float8_e4m3fn", (128, 128), file),
        "m.weight_scale": TensorInfo("m.weight_scale", "float32", (1, 1, 1, 1), file),
    }
    detection = detect(_modelopt(quant_algo="FP8_PB_WO", group_size=None), tensors, SCHEMES)
    assert detection.modules["m"].scheme.name == "modelopt/fp8_pb_wo"


def test_modelopt_mixed_precision_assigns_per_layer() -> None:
    file = Path("model.safetensors")
    tensors = {
        **_nvfp4_module("model.q_proj"),
        "model.down.weight": TensorInfo("model.down.weight", "float8_e4m3fn", (64, 128), file),
        "model.down.weight_scale": TensorInfo("model.down.weight_scale", "float32", (), file),
        "model.down.input_scale": TensorInfo("model.down.input_scale", "float32", (), file),
    }
    layers = {"model.q_proj": MixedPrecisionLayer("NVFP4", 16), "model.down": MixedPrecisionLayer("FP8", None)}
    detection = detect(_modelopt(quant_algo="MIXED_PRECISION", quantized_layers=layers), tensors, SCHEMES)
    assert detection.modules["model.down"].scheme.name == "modelopt/FP8"
    assert detection.modules["model.q_proj"].scheme.name == "modelopt/NVFP4"
    assert detection.modules["model.q_proj"].origin == "quantized_layers.model.q_proj (NVFP4)"


def test_modelopt_excluded_module_with_quantized_tensors_is_an_error() -> None:
    with pytest.raises(CheckpointError, match=r"module model.q_proj is excluded \('model.\*'\) but stores quantized"):
        detect(_modelopt(exclude_modules=("model.*",)), _nvfp4_module("model.q_proj"), SCHEMES)


def test_kv_cache_scales_are_plain_when_the_config_declares_kv_cache() -> None:
    file = Path("model.safetensors")
    tensors = {
        **_nvfp4_module("model.k_proj"),
        "model.k_proj.k_scale": TensorInfo("model.k_proj.k_scale", "float32", (), file),
        # an affine KV cache (ModelOpt FP8_AFFINE_KV_CFG) adds a bias beside each scale
        "model.k_proj.k_bias": TensorInfo("model.k_proj.k_bias", "float32", (64,), file),
    }
    detection = detect(_modelopt(kv_cache_quant_algo="FP8"), tensors, SCHEMES)
    assert detection.kv_cache == ("model.k_proj.k_bias", "model.k_proj.k_scale")
    assert "k_scale" not in detection.modules["model.k_proj"].tensors
    assert "k_bias" not in detection.modules["model.k_proj"].tensors
    # a v_bias elsewhere (BLIP-2-style attention keeps q_bias / v_bias on the attention module)
    # is that module's own tensor, not the KV cache's
    extra = {name: TensorInfo(name, "float32", (64,), file) for name in ("model.attn.q_bias", "model.attn.v_bias")}
    detection = detect(_modelopt(kv_cache_quant_algo="FP8"), {**tensors, **extra}, SCHEMES)
    assert detection.kv_cache == ("model.k_proj.k_bias", "model.k_proj.k_scale")
    assert {"model.attn.q_bias", "model.attn.v_bias"} <= set(detection.plain)


def test_a_group_that_quantizes_activations_only_is_refused_by_name() -> None:
    # weights: null, FP8 per-token inputs on every Linear: the float layers match no quantized module
    inputs = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
    group = ConfigGroup("group_0", ("Linear",), None, inputs, None, "dense")
    tensors = {**_plain("model.q_proj.weight", (64, 128)), **_plain("model.k_proj.weight", (64, 128))}
    with pytest.raises(
        CheckpointError,
        match=r"config\.json: quantization_config\.config_groups\.group_0 quantizes activations only \(weights: "
        r"null, input_activations \{.*strategy: \"token\".*\}\); no scheme describes activation-only quantization",
    ):
        detect(_ct([group]), tensors, SCHEMES)
    outputs = ConfigGroup("group_0", ("Linear",), NVFP4_WEIGHTS, None, FP8_INPUTS, "nvfp4-pack-quantized")
    with pytest.raises(CheckpointError, match=r"group_0: output_activations quantization is not supported"):
        detect(_ct([outputs]), tensors, SCHEMES)


@pytest.mark.parametrize("target", ["re:.*nomatch$", "re:(?i).*nomatch$"], ids=["plain", "with-flags"])
def test_an_activations_only_group_whose_targets_match_no_linear_passes(target: str) -> None:
    """Only a group that really targets linear layers is refused; a regex with inline flags
    (which the joined pre-filter cannot hold) is matched entry by entry, not assumed to match."""
    inputs = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
    group = ConfigGroup("group_1", (target,), None, inputs, None, "dense")
    weights = ConfigGroup("group_0", ("re:.*proj$",), NVFP4_WEIGHTS, None, None, "nvfp4-pack-quantized")
    detection = detect(_ct([weights, group]), _nvfp4_module("model.q_proj"), SCHEMES)
    assert set(detection.modules) == {"model.q_proj"}


def test_a_target_naming_no_stored_module_is_refused_with_the_stored_name() -> None:
    # transformers 5 stores a vision-language model's layers as language_model.model.* while the
    # producer wrote the runtime names, model.language_model.*: the W4A4 group would otherwise fall
    # through to the W4A16 group's regex, its input scale dropped as tolerated
    stored = "language_model.model.layers.0.self_attn.o_proj"
    groups = [
        ConfigGroup("group_0", ("re:.*proj$",), NVFP4_WEIGHTS, None, None, "nvfp4-pack-quantized"),
        ConfigGroup(
            "group_1",
            ("model.language_model.layers.0.self_attn.o_proj",),
            NVFP4_WEIGHTS,
            {**NVFP4_WEIGHTS, "dynamic": "local"},
            None,
            "nvfp4-pack-quantized",
        ),
    ]
    tensors = {**_nvfp4_module(stored, inputs=True), **_nvfp4_module("language_model.model.layers.0.mlp.up_proj")}
    with pytest.raises(CheckpointError) as caught:
        detect(_ct(groups), tensors, SCHEMES)
    assert str(caught.value).startswith(
        "config.json: quantization_config.config_groups.group_1 target "
        "'model.language_model.layers.0.self_attn.o_proj' names no module of the checkpoint; "
        f"the checkpoint stores '{stored}'. Targets must use the names the tensors are stored under"
    )
    renamed = [groups[0], dataclasses.replace(groups[1], targets=(stored,))]
    detection = detect(_ct(renamed), tensors, SCHEMES)
    assert detection.modules[stored].scheme.name == "compressed-tensors/NVFP4"


def test_a_quantized_module_of_a_class_qscheme_does_not_load_says_so() -> None:
    groups = [
        ConfigGroup("group_0", ("re:.*proj$",), NVFP4_WEIGHTS, None, None, "nvfp4-pack-quantized"),
        ConfigGroup("group_1", ("Embedding",), NVFP4_WEIGHTS, None, None, "nvfp4-pack-quantized"),
    ]
    tensors = {**_nvfp4_module("model.q_proj"), **_nvfp4_module("model.embed_tokens")}
    with pytest.raises(
        CheckpointError,
        match=r"module model\.embed_tokens stores quantized tensors .* but no config group targets it and it is not "
        r"in ignore; the config also targets module classes 'Embedding', which qscheme does not load: only linear "
        r"layers become QuantLinear",
    ):
        detect(_ct(groups), tensors, SCHEMES)


def test_a_checkpoint_with_its_config_in_the_019_form_detects_alike(tmp_path: Path) -> None:
    import json
    import shutil

    source = ct_checkpoint("W4A16_ASYM")
    folder = tmp_path / "v019"
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    quant = config["quantization_config"]
    group = quant["config_groups"]["group_0"]
    group.pop("format")  # 0.19: the format only at the top level
    group["weights"].update({"actorder": None, "block_structure": None, "zp_dtype": None, "observer_kwargs": {}})
    group["weights"]["observer"] = "minmax"
    quant["version"] = "0.19.0"
    (folder / "config.json").write_text(json.dumps(config))
    old = detect(read_producer_config(folder), CheckpointFiles(folder).tensors, SCHEMES)
    new = detect(read_producer_config(source), CheckpointFiles(source).tensors, SCHEMES)
    assert {m: a.scheme.name for m, a in old.modules.items()} == {m: a.scheme.name for m, a in new.modules.items()}
    assert old.scheme_counts() == {"compressed-tensors/W4A16_ASYM": 7}


# ---------------------------------------------------------------------------- no config, yet quantized


def _fp8_module(prefix: str) -> dict[str, TensorInfo]:
    file = Path("ck/model.safetensors")
    return {
        f"{prefix}.weight": TensorInfo(f"{prefix}.weight", "float8_e4m3fn", (64, 128), file),
        f"{prefix}.weight_scale": TensorInfo(f"{prefix}.weight_scale", "float32", (), file),
    }


@pytest.mark.parametrize(
    ("tensors", "shown"),
    [
        (_nvfp4_module("model.layers.0.q_proj"), "weight_packed (uint8 [64, 64])"),
        (_fp8_module("model.layers.0.q_proj"), "weight (float8_e4m3fn [64, 128])"),
    ],
    ids=["named like quantized tensors", "fp8 weight next to a scale"],
)
def test_quantized_tensors_without_a_quantization_config_are_refused(
    tensors: dict[str, TensorInfo], shown: str
) -> None:
    config = NoQuantization("ck/config.json", reason="config.json has no quantization_config")
    tensors = {**tensors, **_plain("model.embed_tokens.weight", (512, 128))}
    with pytest.raises(CheckpointError) as caught:
        detect(config, tensors, SCHEMES)
    message = str(caught.value)
    assert message.startswith("ck/config.json: config.json has no quantization_config, so every tensor would load")
    assert "module model.layers.0.q_proj stores quantized-looking tensors" in message and shown in message
    assert "Add the producer's quantization_config to config.json" in message and "hf_quant_config.json" in message


def test_an_unquantized_checkpoint_still_loads_as_plain_tensors() -> None:
    file = Path("model.safetensors")
    tensors = {
        "model.q_proj.weight": TensorInfo("model.q_proj.weight", "bfloat16", (64, 128), file),
        "model.q_proj.bias": TensorInfo("model.q_proj.bias", "bfloat16", (64,), file),
        "model.norm.weight": TensorInfo("model.norm.weight", "bfloat16", (128,), file),
    }
    detection = detect(NoQuantization(None), tensors, SCHEMES)
    assert detection.modules == {} and set(detection.plain) == set(tensors)


def test_a_quantized_tensor_without_a_module_prefix_is_refused() -> None:
    file = Path("model.safetensors")
    tensors = {**_nvfp4_module("model.q_proj"), "weight_packed": TensorInfo("weight_packed", "uint8", (4, 8), file)}
    for config in (_ct([ConfigGroup("group_0", ("Linear",), NVFP4_WEIGHTS, None, None, None)]), NoQuantization(None)):
        with pytest.raises(
            CheckpointError, match=r"tensors weight_packed \(uint8 \[4, 8\]\) look quantized but have no"
        ):
            detect(config, tensors, SCHEMES)


def test_a_bad_regular_expression_in_a_hand_built_config_is_a_checkpoint_error() -> None:
    group = ConfigGroup("group_0", ("re:model.[0",), NVFP4_WEIGHTS, None, None, "nvfp4-pack-quantized")
    with pytest.raises(CheckpointError, match=r"'re:model.\[0' is not a valid regular expression"):
        detect(_ct([group]), _nvfp4_module("model.q_proj"), SCHEMES)


class _NeverMatched:
    def match(self, name: str) -> None:
        raise AssertionError(f"a pattern ran on {name[:20]!r}...")


@pytest.mark.parametrize("kind", ["compressed-tensors", "modelopt"])
def test_a_name_longer_than_the_cap_is_refused_before_any_pattern_runs(kind: str) -> None:
    """With no cap, 're:.*_.*_.*proj$' on 'model.' + 6,000 underscores ran for a minute."""
    long_module = "model." + "_" * (MAX_NAME_LENGTH - len("model.") - len(".weight_packed") + 1)
    tensors = {**_nvfp4_module("model.q_proj"), **_nvfp4_module(long_module)}
    group = ConfigGroup("group_0", ("re:.*_proj$",), NVFP4_WEIGHTS, None, None, "nvfp4-pack-quantized")
    config = dataclasses.replace(_ct([group]), patterns={"re:.*_proj$": _NeverMatched()})
    if kind == "modelopt":
        config = ModeloptConfig("hf_quant_config.json", "NVFP4", 16, (), None)  # type: ignore[assignment]
    with pytest.raises(CheckpointError) as caught:
        detect(config, tensors, SCHEMES)
    message = str(caught.value)
    assert message.startswith("model.safetensors: tensor model.____")
    assert f"has a name of {MAX_NAME_LENGTH + 1:,} characters" in message
    assert f"tensor names of at most {MAX_NAME_LENGTH:,} characters" in message and "rename the tensor" in message
    assert len(message) < 500


def test_a_name_at_the_cap_is_read() -> None:
    module = "model." + "q" * (MAX_NAME_LENGTH - len("model.") - len(".weight_global_scale"))
    group = ConfigGroup("group_0", ("re:.*q$",), NVFP4_WEIGHTS, None, None, "nvfp4-pack-quantized")
    detection = detect(_ct([group]), _nvfp4_module(module), SCHEMES)
    assert list(detection.modules) == [module]


def test_a_malformed_block_structure_matches_no_rule_instead_of_crashing() -> None:
    normalized = normalize_arguments({"block_structure": "128xabc"})
    assert normalized is not None and normalized["block_structure"] == "128xabc"
    assert normalize_arguments({"block_structure": "128x64"})["block_structure"] == [128, 64]  # type: ignore[index]


# ---------------------------------------------------------------------------- ModelOpt group_size


def test_modelopt_group_size_must_equal_the_schemes() -> None:
    with pytest.raises(CheckpointError) as caught:
        detect(_modelopt(group_size=32), _nvfp4_module("model.q_proj"), SCHEMES)
    message = str(caught.value)
    assert message.startswith("hf_quant_config.json: quant_algo 'NVFP4' with group_size 32: scheme modelopt/NVFP4")
    assert "stores one weight scale per 16 weights" in message and "detect.modelopt.group_size: 32" in message
    with pytest.raises(CheckpointError, match=r"group_size is 0; expected a positive number"):
        detect(_modelopt(group_size=0), _nvfp4_module("model.q_proj"), SCHEMES)
    assert detect(_modelopt(group_size=16), _nvfp4_module("model.q_proj"), SCHEMES).modules


@pytest.mark.parametrize("name", ["nvfp4", "nvfp4_exclude", "w4a16_awq", "w4a16_nvfp4", "w4a8_nvfp4_fp8", "mxfp4"])
def test_the_modelopt_fixtures_group_sizes_agree_with_their_schemes(name: str) -> None:
    folder = modelopt_fixture(name)
    detection = detect(read_producer_config(folder), CheckpointFiles(folder).tensors, SCHEMES)
    assert detection.modules


def test_a_group_of_attention_modules_without_weights_is_not_about_linear_layers() -> None:
    # llm-compressor's FP8 attention recipe: a weights-null group on the attention modules (their
    # q/k/v scales), beside the group of the quantized linears
    inputs = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    groups = [
        ConfigGroup("group_0", ("LlamaAttention",), None, inputs, None, "dense"),
        ConfigGroup("group_1", ("Linear",), NVFP4_WEIGHTS, None, None, "nvfp4-pack-quantized"),
    ]
    file = Path("model.safetensors")
    tensors = {
        **_nvfp4_module("model.layers.0.self_attn.q_proj"),
        "model.layers.0.self_attn.k_scale": TensorInfo("model.layers.0.self_attn.k_scale", "float32", (), file),
    }
    detection = detect(_ct(groups), tensors, SCHEMES)
    assert detection.scheme_counts() == {"compressed-tensors/NVFP4A16": 1}
    assert "model.layers.0.self_attn.k_scale" in detection.plain
