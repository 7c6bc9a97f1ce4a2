"""`qscheme inspect` and `qscheme resolve` on a .gguf file, in text and JSON (in process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf_tiny import write_tiny_gguf

from qscheme.cli.main import main


def mixed(name: str, shape: tuple[int, ...]) -> str:
    if len(shape) < 2 or ".ffn_gate_inp." in name:
        return "F32"
    return "Q4_K" if ".attn_" in name else "Q6_K"


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf_cli") / "moe.gguf", "qwen3moe", mixed).path


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, dict[str, object]]:
    code = main(argv)
    return code, json.loads(capsys.readouterr().out)


def test_inspect_json_lists_every_layer_with_its_gguf_type(moe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, report = _json(capsys, ["inspect", str(moe), "--json"])
    assert code == 0 and report["ok"] is True
    assert report["producer"]["name"] == "gguf"  # type: ignore[index]
    modules = {row["module"]: row for row in report["modules"]}  # type: ignore[attr-defined]
    assert modules["model.layers.0.self_attn.k_proj"]["scheme"] == "gguf/Q4_K"
    assert modules["model.layers.0.self_attn.k_proj"]["origin"] == "GGUF Q4_K tensor blk.0.attn_k.weight"
    assert modules["model.layers.1.mlp.experts.2.down_proj"]["scheme"] == "gguf/Q6_K"
    assert report["schemes"] == {"gguf/Q4_K": 8, "gguf/Q6_K": 26}


def test_inspect_text(moe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(moe)]) == 0
    out = capsys.readouterr().out
    assert "architecture qwen3moe" in out and "experts.{0..3}.gate_proj" in out and "problems: none" in out


def test_resolve_json_gives_each_layer_a_kernel_and_trace(moe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, report = _json(capsys, ["resolve", str(moe), "--json", "--device", "cpu"])
    assert code == 0
    layers = {row["layer"]: row for row in report["layers"]}  # type: ignore[attr-defined]
    assert len(layers) == 34
    row = layers["model.layers.0.mlp.experts.0.up_proj"]
    assert row["scheme"] == "gguf/Q6_K" and row["kernel"] is not None
    assert row["problem"]["n"] == 256 and row["problem"]["k"] == 256


def test_resolve_text(moe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["resolve", str(moe), "--device", "cpu"]) == 0
    assert "34 of 34 layers have a kernel" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["inspect", "resolve"])
def test_tensor_parallel_is_refused(moe: Path, command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, str(moe), "--tp", "2"]) == 2
    assert "tensor parallelism is not offered for GGUF files" in capsys.readouterr().err


def test_inspect_reports_an_unknown_architecture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    written = write_tiny_gguf(tmp_path / "falcon.gguf", "llama", mixed, architecture="falcon")
    code, report = _json(capsys, ["inspect", str(written.path), "--json"])
    assert code == 1
    assert "'general.architecture' is 'falcon'" in report["problems"][0]  # type: ignore[index]
