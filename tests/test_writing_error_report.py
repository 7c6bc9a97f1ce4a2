"""The quantization error report (issue 24, point 6): per-layer relative (Frobenius) and max-abs
error in `quantize` (--json and the text summary), relative error for a requantizing `convert`.

The figures are checked against an independent computation: the written checkpoint loaded by
``qscheme.load_checkpoint``, each layer dequantized, compared with the source weight in float64.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from checkpoint_cache import modelopt_fixture
from safetensors.torch import load_file
from test_writing_source import llama_tensors, write_source_checkpoint

import qscheme
from qscheme.cli.main import main
from qscheme.writing.convert import convert_checkpoint
from qscheme.writing.error_report import compare_weights
from qscheme.writing.quantize import quantize_checkpoint


def _expected(reference: torch.Tensor, dequantized: torch.Tensor) -> tuple[float, float]:
    difference = reference.to(torch.float64) - dequantized.to(torch.float64)
    relative = float(difference.norm() / reference.to(torch.float64).norm())
    return relative, float(difference.abs().max())


@pytest.mark.parametrize("scheme", ["compressed-tensors/W4A16", "modelopt/NVFP4", "compressed-tensors/FP8_DYNAMIC"])
def test_each_quantized_layer_reports_its_relative_and_max_abs_error(tmp_path: Path, scheme: str) -> None:
    tensors = llama_tensors(num_layers=1)
    src = write_source_checkpoint(tmp_path / "src", tensors)
    modules = [name[:-7] for name in tensors if name.endswith("proj.weight")]
    calibration = {"format": "qscheme-calibration/1", "input_amax": dict.fromkeys(modules, 2.0)}
    summary = quantize_checkpoint(src, tmp_path / "dst", scheme, calibration=calibration if "NVFP4" in scheme else None)
    loaded = qscheme.load_checkpoint(tmp_path / "dst")
    rows = [row for row in summary.layers if row.action == "quantized"]
    assert len(rows) == 7
    for row in rows:
        relative, max_abs = _expected(tensors[row.name + ".weight"], loaded[row.name].dequantize())
        assert row.relative_error is not None and math.isclose(row.relative_error, relative, rel_tol=1e-5)
        assert row.max_abs_error == pytest.approx(max_abs, rel=1e-6)
        assert 0 < row.relative_error < 0.5  # round-to-nearest of a Gaussian weight: a few percent
    copied = [row for row in summary.layers if row.action == "copied"]
    assert copied and all(row.relative_error is None and row.max_abs_error is None for row in copied)


def test_json_and_text_summaries_carry_the_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tensors = llama_tensors(num_layers=1)
    tensors["model.layers.0.mlp.down_proj.weight"][0, 0] = 4.0  # one outlier: the worst layer
    src = write_source_checkpoint(tmp_path / "src", tensors)
    argv = ["quantize", str(src), str(tmp_path / "dst"), "--scheme", "compressed-tensors/W4A16"]
    assert main([*argv, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    quantized = [row for row in record["layers"] if row["action"] == "quantized"]
    assert all(isinstance(row["relative_error"], float) and row["max_abs_error"] > 0 for row in quantized)
    worst = max(quantized, key=lambda row: row["relative_error"])
    assert worst["name"] == "model.layers.0.mlp.down_proj"
    assert main([*argv, "--force"]) == 0
    out = capsys.readouterr().out
    assert "||W - Q(W)||_F / ||W||_F" in out and "worst 5 of 7 layer(s)" in out
    lines = out.splitlines()
    first = lines.index(next(line for line in lines if line.startswith("quantization error"))) + 1
    assert lines[first].strip().startswith("model.layers.0.mlp.down_proj: relative ")


def test_compare_weights_zero_and_shapes() -> None:
    zero = torch.zeros(4, 8)
    assert compare_weights(zero, zero).relative == 0.0
    assert compare_weights(zero, torch.ones(4, 8)).relative is None  # no relative figure exists
    report = compare_weights(torch.full((2, 2), 2.0), torch.full((2, 2), 1.5))
    assert report.relative == pytest.approx(0.25) and report.max_abs == 0.5


def test_a_requantizing_convert_reports_relative_error_not_ulps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "src"
    shutil.copytree(modelopt_fixture("nvfp4"), source, ignore=shutil.ignore_patterns("reference.safetensors"))
    summary = convert_checkpoint(source, tmp_path / "int4", "compressed-tensors/W4A16", allow_requantize=True)
    reference = load_file(str(modelopt_fixture("nvfp4") / "reference.safetensors"))  # the source, dequantized
    written = qscheme.load_checkpoint(tmp_path / "int4")
    rows = [row for row in summary.layers if row.action == "requantized"]
    assert len(rows) == 7
    for row in rows:
        relative, _ = _expected(reference[row.name], written[row.name].dequantize())
        assert row.max_ulps is None and row.relative_error == pytest.approx(relative, rel=1e-5)
    argv = ["convert", str(source), str(tmp_path / "int4b"), "--to", "compressed-tensors/W4A16", "--allow-requantize"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "ulp" not in out.split("quantization error")[0].replace("max ulps", "")  # no "6.9e+06 ulp"
    row_line = next(line for line in out.splitlines() if line.startswith("model.layers.0.self_attn.q_proj "))
    assert "requantized" in row_line and " - " in row_line  # no ulps for a requantized layer
