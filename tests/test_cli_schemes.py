"""`qscheme schemes`, `show`, `validate`: output, JSON shape and exit codes."""

from __future__ import annotations

import json
import os
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
    assert code == 2 and "Traceback" not in err and "modelopt/NVFP4" in err


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


def test_every_builtin_validates(capsys: pytest.CaptureFixture[str]) -> None:
    files = sorted(str(path) for path in BUILTIN.rglob("*.yaml"))
    code, out, err = run(["validate", *files], capsys)
    assert code == 0 and err == "" and out.count(": ok (") == len(files) == 97


def test_validate_reports_duplicate_names_and_catalog_clashes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    nvfp4 = BUILTIN / "compressed-tensors" / "NVFP4.yaml"
    text = nvfp4.read_text()
    first, second, shadow = tmp_path / "a.yaml", tmp_path / "b.yaml", tmp_path / "shadow.yaml"
    copy = text.replace("name: compressed-tensors/NVFP4", "name: copy/NVFP4", 1)
    copy = copy.replace("format: nvfp4-pack-quantized", "format: copy-quantized", 1)  # no rule overlap
    first.write_text(copy)
    second.write_text(copy)
    shadow.write_text(text)
    monkeypatch.delenv("QSCHEME_SCHEME_PATH", raising=False)
    code, out, err = run(["validate", str(first), str(second), str(shadow), str(nvfp4), str(first)], capsys)
    assert code == 1
    assert out == f"{nvfp4}: ok (compressed-tensors/NVFP4)\n"
    assert (
        f"{first}:1:7: name: scheme name 'copy/NVFP4' is also used by {second}; scheme names must be unique: "
        "rename one of them\n"
    ) in err
    assert f"{second}:1:7: name: scheme name 'copy/NVFP4' is also used by {first}; " in err
    assert (
        f"{shadow}:1:7: name: scheme name 'compressed-tensors/NVFP4' is already defined by {nvfp4} (builtin); "
        "the catalog refuses a second scheme of that name: rename this one\n"
    ) in err
    assert err.endswith("4 of 5 file(s) invalid\n")
    code, out, err = run(["validate", str(first), str(first)], capsys)
    assert code == 0 and err == ""


def test_validate_knows_the_scheme_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "path"
    folder.mkdir()
    text = (BUILTIN / "modelopt" / "FP8.yaml").read_text().replace("name: modelopt/FP8", "name: mine/FP8", 1)
    text = text.replace("quant_algo: FP8", "quant_algo: MINE_FP8", 1)  # a rule of its own (no overlap)
    (folder / "mine.yaml").write_text(text)
    (tmp_path / "draft.yaml").write_text(text)
    monkeypatch.setenv("QSCHEME_SCHEME_PATH", str(folder))
    code, out, _ = run(["validate", str(folder / "mine.yaml")], capsys)
    assert code == 0 and out == f"{folder / 'mine.yaml'}: ok (mine/FP8)\n"
    code, _, err = run(["validate", str(tmp_path / "draft.yaml")], capsys)
    assert code == 1 and f"is already defined by {folder / 'mine.yaml'} (path:{folder})" in err


def test_validate_deep_or_huge_yaml_has_no_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "deep.yaml").write_text("name: " + "[" * 5000 + "]" * 5000 + "\n")
    (tmp_path / "huge.yaml").write_text("name: x\nweight: {format: " + "1" * 5000 + "}\n")
    code, out, err = run(["validate", str(tmp_path / "deep.yaml"), str(tmp_path / "huge.yaml")], capsys)
    assert code == 1 and out == "" and "Traceback" not in err
    assert "nested too deeply" in err and "(a number of 5000 digits) is too large" in err


def test_validate_reports_detect_rules_that_overlap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("QSCHEME_SCHEME_PATH", raising=False)
    nvfp4 = BUILTIN / "modelopt" / "NVFP4.yaml"
    copy = tmp_path / "copy.yaml"
    copy.write_text(nvfp4.read_text().replace("name: modelopt/NVFP4", "name: mine/NVFP4", 1))
    code, out, err = run(["validate", str(copy), str(nvfp4)], capsys)
    assert code == 1 and out == f"{nvfp4}: ok (modelopt/NVFP4)\n"  # the clash is the new file's problem
    # located at the rule (the mapping under detect.modelopt), as the parser locates values
    line = next(n for n, text in enumerate(copy.read_text().splitlines(), 1) if text == "  modelopt:") + 1
    assert (
        f"{copy}:{line}:5: detect.modelopt: matches what the rule of scheme 'modelopt/NVFP4' ({nvfp4} (builtin)) "
        "matches, e.g. quant_algo 'NVFP4', no group_size; a checkpoint whose config says that would be refused as "
        "ambiguous: give the rules different quant_algo names or group_size values, or remove one of them\n"
    ) in err
    # two new files overlapping each other: both are reported, each naming the other
    ct = (BUILTIN / "compressed-tensors" / "W8A8.yaml").read_text()
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    for path, name in ((first, "one/W8A8"), (second, "two/W8A8")):
        path.write_text(
            ct.replace("name: compressed-tensors/W8A8", f"name: {name}", 1).replace(
                "format: int-quantized", "format: mine", 1
            )
        )
    code, out, err = run(["validate", str(first), str(second)], capsys)
    assert code == 1 and out == ""
    assert (
        f"detect.compressed-tensors: matches what the rule of scheme 'two/W8A8' ({second}) matches, e.g. format 'mine'"
        in err
    )
    assert f"detect.compressed-tensors: matches what the rule of scheme 'one/W8A8' ({first}) matches" in err
    assert err.endswith("2 of 2 file(s) invalid\n")


ASYM_G32 = """\
name: acme/W4A16_ASYM_G32
weight:
  format: int4
  packing: int32_k
  tensor: {name: weight_packed, dtype: int32, shape: [N, "ceil(K/8)"]}
  scale:
    granularity: group
    group_size: 32
    format: float
    stored: multiplier
    tensor: {name: weight_scale, dtype: float32, shape: [N, "ceil(K/32)"]}
activation: none
"""
SHAPE_TENSOR = "  shape_tensor: {name: weight_shape, dtype: int64, shape: [2]}\n"


def test_validate_refuses_a_layer_size_no_checkpoint_gives_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("QSCHEME_SCHEME_PATH", raising=False)
    padded = tmp_path / "padded.yaml"
    padded.write_text(ASYM_G32)
    code, out, err = run(["validate", str(padded)], capsys)
    assert code == 1 and out == ""
    assert (
        f"{padded}:5:54: weight.tensor.shape: [N, ceil(K/8)] does not fix K: one stored size stands for 8 values of "
        "K (the last packed column may be padded), and no shape tensor records the layer size, so no checkpoint of "
        "this scheme loads; declare a shape tensor (shape_tensor: {name: weight_shape, dtype: int64, shape: [2]}), "
        "or a layout that fixes K ([N, K/8])\n"
    ) in err
    optional = tmp_path / "optional.yaml"
    optional.write_text(
        ASYM_G32.replace("activation:", SHAPE_TENSOR.replace("[2]}", "[2], optional: true}") + "activation:")
    )
    code, _, err = run(["validate", str(optional)], capsys)
    assert code == 1 and "weight.shape_tensor.optional: 'weight_shape' is optional, but [N, ceil(K/8)]" in err
    # each fix the message names is accepted
    with_shape = tmp_path / "with_shape.yaml"
    with_shape.write_text(ASYM_G32.replace("activation:", SHAPE_TENSOR + "activation:"))
    exact = tmp_path / "exact.yaml"
    exact.write_text(ASYM_G32.replace('"ceil(K/8)"', "K/8").replace("acme/", "exact/"))
    code, out, err = run(["validate", str(with_shape), str(exact)], capsys)
    assert code == 0 and err == "" and out.count(": ok (") == 2


def test_what_validate_accepts_loads_and_runs(tmp_path: Path) -> None:
    """A ragged K (300, not a multiple of 8 or 32): the validated descriptor's tensors load and run."""
    import torch

    from qscheme import QuantLinear, dequantize_weight, quantize_weight
    from qscheme.descriptor import parse_scheme_text
    from qscheme.descriptor.loadable import load_problems

    scheme = parse_scheme_text(ASYM_G32.replace("activation:", SHAPE_TENSOR + "activation:"))
    assert load_problems(scheme) == []
    weight = torch.randn(16, 300)
    tensors = quantize_weight(weight, scheme)
    layer = QuantLinear.from_tensors(scheme, tensors, kernel="reference", activation_dtype="float32")
    assert (layer.out_features, layer.in_features) == (16, 300)
    x = torch.randn(3, 300)
    assert torch.allclose(layer(x), x @ dequantize_weight(tensors, scheme).T, rtol=1e-4, atol=1e-4)
    refused = parse_scheme_text(ASYM_G32)  # parses (a caller may pass N and K), but validate refuses it
    assert [path for path, _ in load_problems(refused)] == ["weight.tensor.shape"]


def test_validate_makes_what_the_catalog_skips_fatal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "path"
    folder.mkdir()
    broken = folder / "broken.yaml"
    broken.write_text((BUILTIN / "modelopt" / "FP8.yaml").read_text().replace("stored: multiplier", "stored: x", 1))
    os.mkfifo(folder / "pipe.yaml")
    mine = tmp_path / "mine.yaml"
    mine.write_text(ASYM_G32.replace("activation:", SHAPE_TENSOR + "activation:"))
    monkeypatch.setenv("QSCHEME_SCHEME_PATH", str(folder))
    code, out, err = run(["validate", str(mine)], capsys)
    assert code == 1 and out == f"{mine}: ok (acme/W4A16_ASYM_G32)\n"
    assert err.startswith("QSCHEME_SCHEME_PATH: 2 problems (the catalog skips these with a warning; validate refuses")
    assert f"{broken}:" in err and "'x' is not one of 'multiplier', 'reciprocal'" in err
    assert f"{folder / 'pipe.yaml'}: is a FIFO (named pipe), not a descriptor file" in err
    # the file given is reported once, as itself, not again as a path problem
    code, _, err = run(["validate", str(broken)], capsys)
    assert err.count("'x' is not one of") == 1 and "QSCHEME_SCHEME_PATH: 1 problem " in err


def test_validate_refuses_names_differing_only_by_case(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("QSCHEME_SCHEME_PATH", raising=False)
    text = (BUILTIN / "modelopt" / "FP8.yaml").read_text().replace("quant_algo: FP8", "quant_algo: OTHER", 1)
    lower = tmp_path / "lower.yaml"
    lower.write_text(text.replace("name: modelopt/FP8", "name: modelopt/fp8", 1))
    code, _, err = run(["validate", str(lower)], capsys)
    assert code == 1
    assert (
        f"{lower}:1:7: name: scheme name 'modelopt/fp8' differs only by case from 'modelopt/FP8', defined by "
        f"{BUILTIN / 'modelopt' / 'FP8.yaml'} (builtin); names are looked up ignoring case"
    ) in err
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text(text.replace("name: modelopt/FP8", "name: acme/Fp8", 1))
    second.write_text(text.replace("name: modelopt/FP8", "name: acme/fP8", 1).replace("OTHER", "OTHER2"))
    code, _, err = run(["validate", str(first), str(second)], capsys)
    assert code == 1 and f"scheme name 'acme/Fp8' differs only by case from 'acme/fP8' in {second}" in err


def test_schemes_lists_what_it_skipped_and_show_warns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "broken.yaml").write_text("name: acme/broken\nweight: 3\n")
    monkeypatch.setenv("QSCHEME_SCHEME_PATH", str(tmp_path))
    monkeypatch.delenv("QSCHEME_STRICT_SCHEMES", raising=False)
    code, out, err = run(["schemes"], capsys)
    assert code == 1 and "compressed-tensors/NVFP4 " in out
    assert f"skipped:\n  skipped {tmp_path / 'broken.yaml'}:2:9: weight: 3 is not a mapping" in out
    assert out.rstrip().splitlines()[-1].endswith("schemes, 1 skipped")
    code, out, err = run(["schemes", "--json"], capsys)
    assert code == 1 and json.loads(out) and err.startswith(f"warning: skipped {tmp_path / 'broken.yaml'}:2:9:")
    code, out, err = run(["show", "modelopt/FP8"], capsys)
    assert code == 0 and "weight_scale" in out
    assert err.startswith(f"warning: skipped {tmp_path / 'broken.yaml'}:2:9:") and "Traceback" not in err
    monkeypatch.setenv("QSCHEME_STRICT_SCHEMES", "1")
    code, out, err = run(["show", "modelopt/FP8"], capsys)
    assert code == 1 and out == "" and f"qscheme show: error: {tmp_path / 'broken.yaml'}:2:9: weight:" in err


@pytest.mark.parametrize("kind", ["fifo", "device", "huge"])
def test_show_and_validate_refuse_special_and_huge_files(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "x.yaml"
    if kind == "fifo":
        os.mkfifo(target)  # opening it would block: the file type is checked first
    elif kind == "huge":
        target.write_bytes(b"#" * (3 << 20))
    name = "/dev/null" if kind == "device" else str(target)
    expected = {
        "fifo": "is a FIFO (named pipe), not a descriptor file",
        "device": "is a character device, not a descriptor file",
        "huge": f"is {3 << 20} bytes; a descriptor is at most 1048576 bytes (1 MiB)",
    }[kind]
    code, out, err = run(["show", name], capsys)
    assert (code, out) == (2, "") and f"qscheme show: error: {name}: {expected}" in err
    code, out, err = run(["validate", name], capsys)
    assert (code, out) == (1, "") and f"{name}: 1 problem\n{name}: {expected}" in err


def test_strict_show_lists_every_problem_of_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    os.mkfifo(tmp_path / "pipe.yaml")
    (tmp_path / "dangling.yaml").symlink_to(tmp_path / "gone.yaml")
    (tmp_path / "broken.yaml").write_text("name: acme/broken\nweight: [\n")
    case = (BUILTIN / "modelopt" / "FP8.yaml").read_text().replace("name: modelopt/FP8", "name: ModelOpt/fp8", 1)
    (tmp_path / "case.yaml").write_text(case.replace("quant_algo: FP8", "quant_algo: OTHER_FP8", 1))
    monkeypatch.setenv("QSCHEME_SCHEME_PATH", str(tmp_path))
    monkeypatch.setenv("QSCHEME_STRICT_SCHEMES", "1")
    code, out, err = run(["show", "modelopt/FP8"], capsys)
    assert (code, out) == (1, "")
    for name in ("pipe.yaml", "dangling.yaml", "broken.yaml", "case.yaml"):
        assert f"{tmp_path / name}" in err, name
    assert "not valid YAML" in err and "differs only by case" in err


def test_a_folder_inside_another_on_the_path_is_no_duplicate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    inner = tmp_path / "acme"
    inner.mkdir()
    (inner / "mine.yaml").write_text(
        (BUILTIN / "modelopt" / "FP8.yaml").read_text().replace("modelopt/FP8", "acme/mine")
    )
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "alias").symlink_to(Path("..") / "acme")  # a sibling folder, not a loop
    monkeypatch.setenv("QSCHEME_SCHEME_PATH", os.pathsep.join([str(tmp_path), str(inner)]))
    monkeypatch.delenv("QSCHEME_STRICT_SCHEMES", raising=False)
    code, out, err = run(["schemes"], capsys)
    assert (code, err) == (0, "") and "skipped" not in out
    assert any(line.startswith("acme/mine ") and line.endswith(f"path:{tmp_path}") for line in out.splitlines())


def test_schemes_shows_each_skipped_file_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "broken.yaml").write_text("name: acme/broken\nweight: 3\n")
    os.mkfifo(tmp_path / "pipe.yaml")
    monkeypatch.setenv("QSCHEME_SCHEME_PATH", str(tmp_path))
    monkeypatch.delenv("QSCHEME_STRICT_SCHEMES", raising=False)
    code, out, err = run(["schemes"], capsys)
    assert code == 1 and err == "" and out.count("\n  skipped ") == 2  # listed in the table, not warned again
    code, out, err = run(["schemes", "--json"], capsys)
    assert code == 1 and json.loads(out) and "warning" not in out
    assert err.count("warning: skipped ") == 2 and err.count(str(tmp_path / "broken.yaml")) == 1


ALIAS_BOMB = """\
a: &a ["x","x","x","x","x","x","x","x","x","x"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b]
name: *c
weight: {}
"""


def test_validate_counts_problems_of_one_kind_instead_of_repeating_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    many = tmp_path / "many.yaml"
    many.write_text("name: x\nweight: {}\n" + "".join(f"k{i}: 1\n" for i in range(5000)))
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(ALIAS_BOMB)
    code, out, err = run(["validate", str(many), str(bomb)], capsys)
    assert code == 1 and out == ""
    assert f"{many}: 5003 problems\n" in err  # the count is of all of them
    assert f"{many}:3:1: k0: unknown key 'k0'; allowed keys are " in err
    assert err.count("unknown key 'k") == 3 and "\n... and 4,997 more like this\n" in err
    assert err.count("an alias of a mapping or list (*name) is not allowed") == 3
    assert "\n... and 18 more like this\n" in err  # 10 in b, 10 in c and name
    assert len(err.splitlines()) < 25
    # what the catalog skips on the path is grouped the same way
    folder = tmp_path / "path"
    folder.mkdir()
    for i in range(6):
        os.mkfifo(folder / f"pipe{i}.yaml")
    monkeypatch.setenv("QSCHEME_SCHEME_PATH", str(folder))
    code, _, err = run(["validate", str(BUILTIN / "modelopt" / "FP8.yaml")], capsys)
    assert code == 1 and err.startswith("QSCHEME_SCHEME_PATH: 6 problems")
    assert err.count("is a FIFO (named pipe), not a descriptor file") == 3 and "\n... and 3 more like this\n" in err
