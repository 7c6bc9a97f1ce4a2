"""qscheme.checkpoint.config: the producer config of a checkpoint folder, typed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from checkpoint_cache import (
    ct_checkpoint,
    modelopt_fixture,
    single_threaded_torch,  # noqa: F401  (autouse)
)

from qscheme.checkpoint.config import (
    CompressedTensorsConfig,
    ModeloptConfig,
    NoQuantization,
    read_producer_config,
)
from qscheme.errors import CheckpointError


def _write(folder: Path, name: str, data: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(data, indent=2))
    return folder


def test_compressed_tensors_020_config_written_by_the_library() -> None:
    config = read_producer_config(ct_checkpoint("NVFP4"))
    assert isinstance(config, CompressedTensorsConfig)
    assert config.producer == "compressed-tensors"
    assert config.producer_version == "0.20.1"
    assert config.ignore == ("lm_head",)
    (group,) = config.groups
    assert group.targets == ("Linear",)
    assert group.format == "nvfp4-pack-quantized"
    assert group.weights is not None and group.weights["strategy"] == "tensor_group"
    assert group.input_activations is not None and group.input_activations["dynamic"] == "local"


def test_compressed_tensors_019_form_with_nulls_and_top_level_format(tmp_path: Path) -> None:
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": True,
        "group_size": 128,
        "strategy": "group",
        "block_structure": None,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
        "observer_kwargs": {},
        "zp_dtype": None,
    }
    quant = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
        "ignore": ["lm_head"],
        "quantization_status": "compressed",
        "sparsity_config": {},
        "version": "0.19.0",
    }
    config = read_producer_config(_write(tmp_path, "config.json", {"quantization_config": quant}))
    assert isinstance(config, CompressedTensorsConfig)
    assert config.format == "pack-quantized"
    assert config.groups[0].format is None
    assert config.producer_version == "0.19.0"


def test_modelopt_hf_quant_config() -> None:
    config = read_producer_config(modelopt_fixture("nvfp4_exclude"))
    assert isinstance(config, ModeloptConfig)
    assert config.file.endswith("hf_quant_config.json")
    assert config.quant_algo == "NVFP4"
    assert config.group_size == 16
    assert config.exclude_modules == (
        "lm_head",
        "model.embed_tokens",
        "model.layers.0.mlp.down_proj",
        "model.layers.1*",
    )
    assert config.producer_version == "0.47.0"


def test_modelopt_from_config_json_alone(tmp_path: Path) -> None:
    source = json.loads((modelopt_fixture("nvfp4") / "config.json").read_text())
    config = read_producer_config(_write(tmp_path, "config.json", source))
    assert isinstance(config, ModeloptConfig)
    assert config.quant_algo == "NVFP4"
    assert config.exclude_modules == ("lm_head", "model.embed_tokens")
    assert config.group_size == 16  # from config_groups


def test_modelopt_mixed_precision(tmp_path: Path) -> None:
    data = {
        "producer": {"name": "modelopt", "version": "0.47.0"},
        "quantization": {
            "quant_algo": "MIXED_PRECISION",
            "quantized_layers": {
                "model.layers.0.mlp.down_proj": {"quant_algo": "FP8"},
                "model.layers.0.self_attn.q_proj": {"quant_algo": "NVFP4", "group_size": 16},
            },
        },
    }
    config = read_producer_config(_write(tmp_path, "hf_quant_config.json", data))
    assert isinstance(config, ModeloptConfig) and config.mixed_precision
    assert config.quantized_layers is not None
    assert config.quantized_layers["model.layers.0.self_attn.q_proj"].group_size == 16


def test_no_quantization_config(tmp_path: Path) -> None:
    config = read_producer_config(_write(tmp_path, "config.json", {"hidden_size": 8}))
    assert isinstance(config, NoQuantization)


def test_bad_json_names_file_line_and_column(tmp_path: Path) -> None:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text('{\n  "quantization_config": {\n    "quant_method": "compressed-tensors",,\n')
    with pytest.raises(CheckpointError) as caught:
        read_producer_config(tmp_path)
    assert f"{tmp_path / 'config.json'}:3:42: invalid JSON" in str(caught.value)


def test_wrong_type_names_key_path(tmp_path: Path) -> None:
    quant = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"targets": "Linear", "weights": 4}}}
    with pytest.raises(
        CheckpointError, match=r"quantization_config\.config_groups\.group_0\.weights: expected an object"
    ):
        read_producer_config(_write(tmp_path, "config.json", {"quantization_config": quant}))


def test_unsupported_method_and_conflicting_files(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="quant_method 'gptq' is not supported"):
        read_producer_config(_write(tmp_path / "a", "config.json", {"quantization_config": {"quant_method": "gptq"}}))
    folder = _write(tmp_path / "b", "config.json", {"quantization_config": {"quant_method": "compressed-tensors"}})
    _write(folder, "hf_quant_config.json", {"quantization": {"quant_algo": "NVFP4"}})
    with pytest.raises(CheckpointError, match=r"hf_quant_config.json \(a ModelOpt export\) is also present"):
        read_producer_config(folder)


def test_uncompressed_status_is_refused(tmp_path: Path) -> None:
    quant = {
        "quant_method": "compressed-tensors",
        "quantization_status": "frozen",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8}}},
    }
    with pytest.raises(CheckpointError, match="quantization_status is 'frozen'"):
        read_producer_config(_write(tmp_path, "config.json", {"quantization_config": quant}))
