"""The catalog: built-ins, QSCHEME_SCHEME_PATH folders, duplicate names, lookups."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from qscheme.catalog import build_catalog, builtin_scheme_dir, descriptor_files, load_catalog, load_scheme
from qscheme.errors import SchemeError

BUILTIN = Path(__file__).resolve().parents[1] / "schemes"
E5M2_TEXT = """\
name: test/fp8-e5m2-weight-only
description: fp8 e5m2 weights, one scale per output channel, 16-bit activations
weight:
  format: e5m2
  tensor: {name: weight, dtype: float8_e5m2, shape: [N, K]}
  scale:
    granularity: channel
    format: fp32
    stored: multiplier
    tensor: {name: weight_scale, dtype: float32, shape: [N, 1]}
activation: none
"""


def test_builtins_are_all_there() -> None:
    catalog = load_catalog(include_plugins=False)
    names = {scheme.name for scheme in catalog}
    expected = {
        *(
            f"compressed-tensors/{n}"
            for n in (
                "NVFP4",
                "NVFP4A16",
                "FP8",
                "FP8_DYNAMIC",
                "FP8_BLOCK",
                "W4A16",
                "W4A16_ASYM",
                "W8A8",
                "MXFP4",
                "MXFP4A16",
            )
        ),
        *(
            f"modelopt/{n}"
            for n in ("NVFP4", "W4A16_NVFP4", "NVFP4_AWQ", "W4A8_NVFP4_FP8", "FP8", "fp8_pb_wo", "W4A16_AWQ", "mxfp4")
        ),
    }
    assert expected <= names
    assert all(scheme.source == "builtin" for scheme in catalog if scheme.name in expected)


def test_builtin_dir_is_the_installed_package() -> None:
    files = sorted(p.name for p in builtin_scheme_dir().rglob("*.yaml"))
    assert len(files) >= 18


def test_scheme_path_adds_schemes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "e5m2.yaml").write_text(E5M2_TEXT)
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.setenv("QSCHEME_SCHEME_PATH", f"{tmp_path}{os.pathsep}{other}")
    scheme = load_catalog(include_plugins=False).get("test/fp8-e5m2-weight-only")
    assert scheme.source == f"path:{tmp_path}"
    assert scheme.path == str(tmp_path / "e5m2.yaml")
    assert scheme.weight_family == "fp8"


def test_duplicate_names_name_both_files(tmp_path: Path) -> None:
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text(E5M2_TEXT)
    second.write_text(E5M2_TEXT)
    with pytest.raises(SchemeError) as info:
        build_catalog([("path:x", first), ("path:x", second)])
    message = str(info.value)
    assert str(first) in message and str(second) in message and "already defined" in message


def test_duplicate_of_a_builtin_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "nvfp4.yaml").write_text((BUILTIN / "compressed-tensors" / "NVFP4.yaml").read_text())
    monkeypatch.setenv("QSCHEME_SCHEME_PATH", str(tmp_path))
    with pytest.raises(SchemeError, match="compressed-tensors/NVFP4"):
        load_catalog(include_plugins=False)


def test_broken_file_on_path_is_reported_with_location(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "bad.yaml").write_text(E5M2_TEXT.replace("granularity: channel", "granularity: row"))
    monkeypatch.setenv("QSCHEME_SCHEME_PATH", str(tmp_path))
    with pytest.raises(SchemeError, match=r"bad\.yaml:7:18: weight\.scale\.granularity: 'row'"):
        load_catalog(include_plugins=False)


def test_missing_folder_on_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("QSCHEME_SCHEME_PATH", str(tmp_path / "nowhere"))
    with pytest.raises(SchemeError, match="not a folder"):
        load_catalog(include_plugins=False)


def test_lookup_is_case_insensitive_and_suggests() -> None:
    catalog = load_catalog(include_plugins=False)
    assert catalog.get("compressed-tensors/nvfp4").name == "compressed-tensors/NVFP4"
    with pytest.raises(SchemeError, match="Did you mean 'compressed-tensors/NVFP4'"):
        catalog.get("compressed-tensors/NVFP5")


def test_load_scheme_from_file(tmp_path: Path) -> None:
    path = tmp_path / "e5m2.yaml"
    path.write_text(E5M2_TEXT)
    assert load_scheme(str(path)).name == "test/fp8-e5m2-weight-only"
    with pytest.raises(SchemeError, match="does not exist"):
        load_scheme(str(tmp_path / "missing.yaml"))


def test_catalog_is_reused_until_a_descriptor_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "e5m2.yaml"
    path.write_text(E5M2_TEXT)
    monkeypatch.setenv("QSCHEME_SCHEME_PATH", str(tmp_path))
    first = load_catalog(include_plugins=False)
    assert load_catalog(include_plugins=False) is first
    path.write_text(E5M2_TEXT.replace("test/fp8-e5m2-weight-only", "test/renamed") + "\n")
    second = load_catalog(include_plugins=False)
    assert second is not first
    assert "test/renamed" in second and "test/fp8-e5m2-weight-only" not in second
    (tmp_path / "extra.yaml").write_text(E5M2_TEXT)
    assert "test/fp8-e5m2-weight-only" in load_catalog(include_plugins=False)


def test_a_folder_is_not_a_descriptor_file(tmp_path: Path) -> None:
    (tmp_path / "schemes.yaml").mkdir()
    with pytest.raises(SchemeError, match="is a folder, not a descriptor file"):
        load_scheme(str(tmp_path / "schemes.yaml"))
    with pytest.raises(SchemeError, match="is a folder, not a descriptor file"):
        load_scheme(str(tmp_path))


def test_hidden_files_and_folders_are_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mine.yaml").write_text(E5M2_TEXT)
    (tmp_path / "._mine.yaml").write_bytes(b"\0\5\26\7AppleDouble")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "copy.yaml").write_text(E5M2_TEXT)
    assert descriptor_files(tmp_path) == [tmp_path / "mine.yaml"]
    monkeypatch.setenv("QSCHEME_SCHEME_PATH", str(tmp_path))
    assert "test/fp8-e5m2-weight-only" in load_catalog(include_plugins=False)


def test_unreadable_subfolder_is_a_problem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mine.yaml").write_text(E5M2_TEXT)
    locked = tmp_path / "locked"
    locked.mkdir()
    real_scandir = os.scandir

    def scandir(path: object) -> object:  # chmod 000 does not stop root: refuse the folder here
        if Path(str(path)) == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setenv("QSCHEME_SCHEME_PATH", str(tmp_path))
    with pytest.raises(SchemeError) as info:
        load_catalog(include_plugins=False)
    assert str(info.value) == f"{locked}: cannot read this scheme folder: Permission denied; make it readable " + (
        "(chmod +rx), or move it away"
    )
    with pytest.raises(SchemeError, match="cannot read this scheme folder"):
        descriptor_files(tmp_path)


def test_a_folder_named_twice_is_read_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "e5m2.yaml").write_text(E5M2_TEXT)
    again = tmp_path / "sub" / ".."
    (tmp_path / "sub").mkdir()
    monkeypatch.setenv("QSCHEME_SCHEME_PATH", os.pathsep.join([str(tmp_path), str(again), str(builtin_scheme_dir())]))
    catalog = load_catalog(include_plugins=False)
    assert catalog.get("test/fp8-e5m2-weight-only").source == f"path:{tmp_path}"
    assert catalog.get("compressed-tensors/NVFP4").source == "builtin"


def test_nul_byte_on_path_is_located(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "bad.yaml").write_text(E5M2_TEXT.replace("activation: none", "activation: no\0ne"))
    monkeypatch.setenv("QSCHEME_SCHEME_PATH", str(tmp_path))
    with pytest.raises(SchemeError, match=r"bad\.yaml:11:15: not valid YAML: character U\+0000 is not allowed"):
        load_catalog(include_plugins=False)


@pytest.mark.parametrize(
    "text",
    ["name: " + "[" * 5000 + "]" * 5000 + "\n", E5M2_TEXT.replace("[N, K]", "[N, " + "9" * 5000 + "]")],
    ids=["deep", "5000 digits"],
)
def test_yaml_python_cannot_read_is_a_scheme_error(text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "bad.yaml").write_text(text)
    monkeypatch.setenv("QSCHEME_SCHEME_PATH", str(tmp_path))
    with pytest.raises(SchemeError, match=rf"^{re.escape(str(tmp_path / 'bad.yaml'))}:\d+:\d+: "):
        load_catalog(include_plugins=False)
