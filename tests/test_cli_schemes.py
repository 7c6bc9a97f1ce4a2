"""`qscheme schemes`, `show`, `validate`: output, JSON shape and exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qscheme.cli.main import main

BUILTIN = Path(__file__).resolve().parents[1] / "schemes"


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_schemes_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["schemes", "--json"], capsys)
    assert code == 0
    records = json.loads(out)
    by_name = {r["name"]: r for r in records}
    assert by_name["compressed-tensors/NVFP4A16"]["activation_format"] == "none"
    assert by_name["compressed-tensors/NVFP4A16"]["weight_format"] == "nvfp4"
    assert by_name["modelopt/W4A8_NVFP4_FP8"]["activation_format"] == "fp8"
    assert by_name["compressed-tensors/W4A16"]["weight_format"] == "int4"
    assert by_name["compressed-tensors/MXFP4"]["weight_format"] == "mxfp4"
    assert by_name["modelopt/FP8"]["producer"] == "modelopt"
    for record in records:
        assert {"name", "producer", "weight_format", "activation_format", "source", "path"} <= set(record)


def test_schemes_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["schemes"], capsys)
    assert code == 0 and "compressed-tensors/NVFP4 " in out and "schemes" in out.splitlines()[-1]


def test_show_text_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["show", "modelopt/NVFP4"], capsys)
    assert code == 0 and "weight_scale_2" in out and "multiplier" in out
    code, out, _ = run(["show", str(BUILTIN / "compressed-tensors" / "NVFP4.yaml"), "--json"], capsys)
    data = json.loads(out)
    assert data["tensors"]["weight_global_scale"]["stored"] == "reciprocal"
    assert data["weight"]["scale"]["group_size"] == 16


def test_show_unknown_is_error_without_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    code, _out, err = run(["show", "modelopt/NVFP5"], capsys)
    assert code == 1 and "Traceback" not in err and "modelopt/NVFP4" in err


def test_validate_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = BUILTIN / "modelopt" / "FP8.yaml"
    bad = tmp_path / "bad.yaml"
    bad.write_text(good.read_text().replace("stored: multiplier", "stored: invert"))
    code, out, _ = run(["validate", str(good)], capsys)
    assert code == 0 and "ok" in out
    code, out, err = run(["validate", str(good), str(bad)], capsys)
    assert code == 1
    assert err.count("'invert' is not one of 'multiplier', 'reciprocal'") == 2
    assert f"{bad}:" in err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main(["validate"])
    assert info.value.code == 2
    assert main([]) == 2
