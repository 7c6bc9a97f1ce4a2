"""`qscheme quantize`: text and --json summaries, exit codes, and a YAML-only scheme's
self-describing checkpoint loaded and inspected by a fresh process that never saw the YAML."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_writing_source import llama_tensors, write_source_checkpoint

from qscheme.cli.main import main

YAML_SCHEME = Path(__file__).parent / "data" / "triton_schemes" / "uint4_g48_zero_points.yaml"


def test_text_summary_and_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write_source_checkpoint(tmp_path / "src", llama_tensors(num_layers=1))
    code = main(["quantize", str(src), str(tmp_path / "dst"), "--scheme", "compressed-tensors/W4A16"])
    out = capsys.readouterr().out
    assert code == 0
    assert "2 copied" in out and "7 quantized" in out and "compressed-tensors/W4A16" in out


def test_json_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write_source_checkpoint(tmp_path / "src", llama_tensors(num_layers=1))
    argv = ["quantize", str(src), str(tmp_path / "dst"), "--scheme", "modelopt/W4A16_NVFP4", "--ignore", "lm_head"]
    assert main([*argv, "--json"]) == 0
    captured = capsys.readouterr().out
    record = json.loads(captured)
    assert record["layers_written"] == 7 and record["scheme"] == "modelopt/W4A16_NVFP4"
    assert record["shards"] == ["model.safetensors"] and record["bytes_written"] > 0
    assert {row["action"] for row in record["layers"]} == {"quantized", "copied"}
    assert main([*argv, "--json"]) == 1  # DST exists now: reported like any error, also as JSON
    captured_error = capsys.readouterr()
    assert "already exists" in captured_error.err
    error = json.loads(captured_error.out)["error"]
    assert error["type"] == "DestinationError" and error["exit_code"] == 1 and "--force" in error["message"]


def test_usage_and_input_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write_source_checkpoint(tmp_path / "src", llama_tensors(num_layers=1))
    assert main(["quantize", str(src), str(tmp_path / "dst"), "--scheme", "compressed-tensors/NOPE"]) == 2
    assert (
        main(["quantize", str(tmp_path / "none"), str(tmp_path / "dst"), "--scheme", "compressed-tensors/W4A16"]) == 2
    )
    assert main(["quantize", str(src), str(tmp_path / "dst"), "--scheme", "compressed-tensors/FP8"]) == 2
    assert "--calibration FILE" in capsys.readouterr().err
    assert not (tmp_path / "dst").exists()


@pytest.mark.subprocess
def test_yaml_only_scheme_loads_in_a_fresh_process_without_the_yaml(tmp_path: Path) -> None:
    tensors = llama_tensors(num_layers=1, dtype=torch.float32)
    src = write_source_checkpoint(tmp_path / "src", tensors)
    scheme_file = tmp_path / "schemes" / "mine.yaml"
    scheme_file.parent.mkdir()
    shutil.copyfile(YAML_SCHEME, scheme_file)
    assert main(["quantize", str(src), str(tmp_path / "dst"), "--scheme", str(scheme_file)]) == 0
    shutil.rmtree(scheme_file.parent)  # the YAML is on no path now
    config = json.loads((tmp_path / "dst" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "qscheme" and config["scheme"] == "test/UINT4_G48_ZP"
    code = (
        "import sys, json, torch, qscheme\n"
        "from safetensors.torch import load_file\n"
        "checkpoint = qscheme.load_checkpoint(sys.argv[1])\n"
        "source = load_file(sys.argv[2])\n"
        "scheme = checkpoint.report.layers[0].scheme\n"
        "same = all(torch.equal(checkpoint[m].dequantize(), qscheme.dequantize_weight("
        "qscheme.quantize_weight(source[m + '.weight'], checkpoint[m].weight_canonical.scheme), "
        "checkpoint[m].weight_canonical.scheme)) for m in checkpoint)\n"
        "print(json.dumps({'modules': len(checkpoint), 'scheme': scheme, 'same': same}))\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "QSCHEME_SCHEME_PATH"}
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "dst"), str(src / "model.safetensors")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {
        "modules": 7,
        "scheme": "test/UINT4_G48_ZP",
        "same": True,
    }
    inspected = subprocess.run(
        [sys.executable, "-m", "qscheme.cli.main", "inspect", str(tmp_path / "dst"), "--json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert inspected.returncode == 0, inspected.stderr
    record = json.loads(inspected.stdout)
    assert {row["scheme"] for row in record["modules"]} == {"test/UINT4_G48_ZP"}
