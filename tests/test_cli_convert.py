"""`qscheme convert`: text and JSON summaries with per-layer ulps, exit codes, nothing written on error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from checkpoint_cache import modelopt_fixture
from checkpoint_cache import single_threaded_torch as single_threaded_torch

from qscheme.cli.main import main


def source_copy(tmp_path: Path, fixture: str = "w4a16_nvfp4") -> Path:
    folder = tmp_path / "src"
    shutil.copytree(modelopt_fixture(fixture), folder, ignore=shutil.ignore_patterns("reference.safetensors"))
    return folder


def test_text_summary_lists_each_layer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = source_copy(tmp_path)
    assert main(["convert", str(source), str(tmp_path / "ct"), "--to", "compressed-tensors/NVFP4A16"]) == 0
    out = capsys.readouterr().out
    assert "convert:" in out and "7 converted" in out and "max ulps" in out
    assert "model.layers.0.self_attn.q_proj  converted" in out


def test_json_summary_and_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = source_copy(tmp_path)
    assert main(["convert", str(source), str(tmp_path / "ct"), "--to", "compressed-tensors/NVFP4A16", "--json"]) == 0
    there = json.loads(capsys.readouterr().out)
    assert there["command"] == "convert" and there["scheme"] == "compressed-tensors/NVFP4A16"
    converted = [row for row in there["layers"] if row["action"] == "converted"]
    assert len(converted) == 7 and all(isinstance(row["max_ulps"], float) for row in converted)
    assert (
        main(["convert", str(tmp_path / "ct"), str(tmp_path / "back"), "--to", "modelopt/W4A16_NVFP4", "--json"]) == 0
    )
    back = json.loads(capsys.readouterr().out)
    assert [row["max_ulps"] for row in back["layers"]] == [row["max_ulps"] for row in there["layers"]]
    assert (tmp_path / "back" / "model.safetensors").read_bytes() != b""


def test_refused_requantization_exit_2_then_allowed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = source_copy(tmp_path)
    assert main(["convert", str(source), str(tmp_path / "int4"), "--to", "compressed-tensors/W4A16"]) == 2
    error = capsys.readouterr().err
    assert "modelopt/W4A16_NVFP4" in error and "compressed-tensors/W4A16" in error and "--allow-requantize" in error
    assert not (tmp_path / "int4").exists()
    argv = ["convert", str(source), str(tmp_path / "int4"), "--to", "compressed-tensors/W4A16", "--allow-requantize"]
    assert main(argv) == 0
    assert "requantized" in capsys.readouterr().out


def test_unknown_scheme_and_existing_destination(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = source_copy(tmp_path, "fp8")
    assert main(["convert", str(source), str(tmp_path / "out"), "--to", "nope/NOPE"]) == 2
    assert "nope/NOPE" in capsys.readouterr().err and not (tmp_path / "out").exists()
    (tmp_path / "out").mkdir()
    assert main(["convert", str(source), str(tmp_path / "out"), "--to", "compressed-tensors/FP8"]) == 1
    assert "already exists" in capsys.readouterr().err and not any((tmp_path / "out").iterdir())
    assert main(["convert", str(source), str(tmp_path / "out"), "--to", "compressed-tensors/FP8", "--force"]) == 0
    assert (tmp_path / "out" / "config.json").exists()
