"""qscheme.checkpoint.config: the producer config of a checkpoint folder, typed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from checkpoint_cache import (
    ct_checkpoint,
    modelopt_fixture,
    single_threaded_torch,  # noqa: F401  (autouse)
)

from qscheme.checkpoint.config import NoQuantization, read_producer_config
from qscheme.errors import CheckpointError
from qscheme.producers.compressed_tensors import CompressedTensorsConfig
from qscheme.producers.modelopt import ModeloptConfig


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
    with pytest.raises(CheckpointError, match="quant_method 'hqq' is not supported"):
        read_producer_config(_write(tmp_path / "a", "config.json", {"quantization_config": {"quant_method": "hqq"}}))
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


@pytest.mark.parametrize(
    ("section", "value", "said"),
    [
        ("sparsity_config", {"format": "sparse-24-bitmask"}, "2:4 bitmask or marlin-24 compressed weights"),
        ("transform_config", {"config_groups": {"R1": {}}}, "rotations such as SpinQuant or QuIP"),
    ],
)
def test_sections_that_change_what_the_tensors_mean_are_refused_with_a_reason(
    tmp_path: Path, section: str, value: dict[str, object], said: str
) -> None:
    quant = {
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8}}},
        section: value,
    }
    with pytest.raises(CheckpointError) as caught:
        read_producer_config(_write(tmp_path, "config.json", {"quantization_config": quant}))
    message = str(caught.value)
    assert f"quantization_config.{section} is set" in message and said in message and "re-export" in message


# ---------------------------------------------------------------------------- files that are not regular


def _not_a_file(path: Path, kind: str) -> None:
    if kind == "folder":
        path.mkdir()
    elif kind == "broken link":
        path.symlink_to(path.parent / "gone.json")
    else:
        os.mkfifo(path)


@pytest.mark.parametrize("name", ["config.json", "hf_quant_config.json"])
@pytest.mark.parametrize(
    ("kind", "said"),
    [("folder", "is a folder"), ("broken link", "is a broken symbolic link"), ("fifo", "is a FIFO")],
)
def test_a_config_that_is_not_a_regular_file_is_an_error_not_absent(
    tmp_path: Path, name: str, kind: str, said: str
) -> None:
    _not_a_file(tmp_path / name, kind)
    with pytest.raises(CheckpointError) as caught:
        read_producer_config(tmp_path)
    assert str(caught.value).startswith(f"{tmp_path / name}: {said}")
    assert "must be a regular JSON file" in str(caught.value)


def test_no_quantization_says_why(tmp_path: Path) -> None:
    assert "there is no config.json" in read_producer_config(tmp_path).reason  # type: ignore[union-attr]
    null = read_producer_config(_write(tmp_path / "a", "config.json", {"quantization_config": None}))
    assert isinstance(null, NoQuantization) and "quantization_config is null" in null.reason


# ---------------------------------------------------------------------------- JSON that crashed the parser


def test_duplicate_keys_are_refused_naming_the_key(tmp_path: Path) -> None:
    tmp_path.joinpath("config.json").write_text(
        '{"hidden_size": 8, "quantization_config": {"quant_method": "gptq"}, "quantization_config": null}'
    )
    with pytest.raises(CheckpointError, match=r"config.json: key 'quantization_config' appears more than once"):
        read_producer_config(tmp_path)


def test_duplicate_keys_in_hf_quant_config_are_refused(tmp_path: Path) -> None:
    tmp_path.joinpath("hf_quant_config.json").write_text(
        '{"quantization": {"quant_algo": "NVFP4", "group_size": 16, "group_size": 32}}'
    )
    with pytest.raises(CheckpointError, match=r"hf_quant_config.json: key 'group_size' appears more than once"):
        read_producer_config(tmp_path)


def test_deep_nesting_and_huge_integers_name_the_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match=r"config.json: invalid JSON: arrays or objects nested too deeply"):
        read_producer_config(tmp_path)
    (tmp_path / "config.json").write_text('{"quantization_config": {"group_size": 1' + "0" * 5000 + "}}")
    with pytest.raises(CheckpointError, match=r"config.json: invalid JSON value: a number has more than 4300 digits"):
        read_producer_config(tmp_path)


def test_a_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_bytes(b"\xef\xbb\xbf" + json.dumps({"hidden_size": 8}).encode())
    assert isinstance(read_producer_config(tmp_path), NoQuantization)


# ---------------------------------------------------------------------------- values checked when read


def _ct_config(weights: dict[str, object], targets: list[str], ignore: list[str] | None = None) -> dict[str, object]:
    group = {"targets": targets, "weights": weights, "format": "float-quantized"}
    quant = {"quant_method": "compressed-tensors", "config_groups": {"group_0": group}, "ignore": ignore or []}
    return {"quantization_config": quant}


FP8_BLOCK = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}


def test_bad_regular_expressions_name_the_key_path_and_the_error(tmp_path: Path) -> None:
    bad_target = _ct_config(FP8_BLOCK, ["Linear", "re:model.layers.[0"])
    with pytest.raises(CheckpointError) as caught:
        read_producer_config(_write(tmp_path / "a", "config.json", bad_target))
    assert (
        "config.json: quantization_config.config_groups.group_0.targets[1]: 're:model.layers.[0' is not a valid "
        "regular expression (unterminated character set at 13)"
    ) in str(caught.value)
    bad_ignore = _ct_config(FP8_BLOCK, ["Linear"], ignore=["lm_head", "re:("])
    with pytest.raises(CheckpointError, match=r"quantization_config\.ignore\[1\]: 're:\(' is not a valid regular"):
        read_producer_config(_write(tmp_path / "b", "config.json", bad_ignore))


@pytest.mark.parametrize("block", ["128xabc", "128x", [None, "x"], [1.5, 2], [0, 128], [128], True])
def test_bad_block_structure_names_the_key_path(tmp_path: Path, block: object) -> None:
    data = _ct_config({**FP8_BLOCK, "block_structure": block}, ["Linear"])
    with pytest.raises(CheckpointError) as caught:
        read_producer_config(_write(tmp_path, "config.json", data))
    assert "quantization_config.config_groups.group_0.weights.block_structure: expected two positive sizes" in str(
        caught.value
    )
    assert json.dumps(block) in str(caught.value)


@pytest.mark.parametrize("block", ["128x128", [128, 128], None])
def test_good_block_structures_are_read(tmp_path: Path, block: object) -> None:
    data = _ct_config({**FP8_BLOCK, "block_structure": block}, ["Linear"])
    config = read_producer_config(_write(tmp_path, "config.json", data))
    assert isinstance(config, CompressedTensorsConfig)


@pytest.mark.parametrize("size", [0, -16])
def test_modelopt_group_size_below_one_is_refused(tmp_path: Path, size: int) -> None:
    data = {"quantization": {"quant_algo": "NVFP4", "group_size": size}}
    with pytest.raises(
        CheckpointError, match=rf"hf_quant_config.json: quantization.group_size: expected a positive .* found {size}"
    ):
        read_producer_config(_write(tmp_path, "hf_quant_config.json", data))
    layers = {"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": {"m": {"quant_algo": "NVFP4"}}}}
    layers["quantization"]["quantized_layers"]["m"]["group_size"] = size  # type: ignore[index]
    with pytest.raises(CheckpointError, match=r"quantization.quantized_layers.m.group_size: expected a positive"):
        read_producer_config(_write(tmp_path / "b", "hf_quant_config.json", layers))
