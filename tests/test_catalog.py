"""The catalog: built-ins, QSCHEME_SCHEME_PATH folders, duplicate names, lookups."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import pytest

from qscheme.catalog import (
    Catalog,
    SchemePathWarning,
    build_catalog,
    builtin_scheme_dir,
    descriptor_files,
    load_catalog,
    load_scheme,
)
from qscheme.errors import SchemeError, SchemeNotFoundError

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


def skipping(monkeypatch: pytest.MonkeyPatch, *folders: Path) -> tuple[Catalog, list[str]]:
    """The catalog with ``folders`` on QSCHEME_SCHEME_PATH (not strict), and the warnings it gave."""
    monkeypatch.setenv("QSCHEME_SCHEME_PATH", os.pathsep.join(str(folder) for folder in folders))
    monkeypatch.delenv("QSCHEME_STRICT_SCHEMES", raising=False)
    with pytest.warns(SchemePathWarning) as record:
        catalog = load_catalog(include_plugins=False)
    return catalog, [str(warning.message) for warning in record]


def strict_error(monkeypatch: pytest.MonkeyPatch) -> str:
    """The SchemeError the same catalog raises under QSCHEME_STRICT_SCHEMES=1."""
    monkeypatch.setenv("QSCHEME_STRICT_SCHEMES", "1")
    with pytest.raises(SchemeError) as info:
        load_catalog(include_plugins=False)
    monkeypatch.delenv("QSCHEME_STRICT_SCHEMES")
    return str(info.value)


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


def test_duplicate_of_a_builtin_is_skipped_with_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "nvfp4.yaml").write_text((BUILTIN / "compressed-tensors" / "NVFP4.yaml").read_text())
    (tmp_path / "e5m2.yaml").write_text(E5M2_TEXT)
    catalog, messages = skipping(monkeypatch, tmp_path)
    assert catalog.get("compressed-tensors/NVFP4").source == "builtin"  # never shadowed
    assert "test/fp8-e5m2-weight-only" in catalog  # the good file beside it still loads
    (message,) = messages
    assert message.startswith(
        f"skipped {tmp_path / 'nvfp4.yaml'}: scheme name 'compressed-tensors/NVFP4' is already defined by "
        f"{BUILTIN / 'compressed-tensors' / 'NVFP4.yaml'} (builtin); rename one of them\n"
    )
    assert "QSCHEME_STRICT_SCHEMES=1 makes this an error" in message
    assert [str(problem.location.file) for problem in catalog.skipped] == [str(tmp_path / "nvfp4.yaml")]
    assert "compressed-tensors/NVFP4" in strict_error(monkeypatch)


def test_a_name_differing_from_a_builtin_only_by_case_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = (BUILTIN / "modelopt" / "FP8.yaml").read_text().replace("name: modelopt/FP8", "name: ModelOpt/fp8", 1)
    (tmp_path / "fp8.yaml").write_text(text.replace("quant_algo: FP8", "quant_algo: OTHER_FP8", 1))
    catalog, messages = skipping(monkeypatch, tmp_path)
    assert catalog.get("ModelOpt/fp8").source == "builtin"  # the lookup finds the built-in, unambiguously
    assert "scheme name 'ModelOpt/fp8' differs only by case from 'modelopt/FP8'" in messages[0]
    assert str(tmp_path / "fp8.yaml") in messages[0]
    assert "differs only by case" in strict_error(monkeypatch)
    with pytest.raises(SchemeError, match="differs only by case from 'modelopt/FP8'"):
        build_catalog([("builtin", BUILTIN / "modelopt" / "FP8.yaml"), ("path:x", tmp_path / "fp8.yaml")])


def test_broken_file_on_path_is_skipped_with_a_located_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "bad.yaml").write_text(E5M2_TEXT.replace("granularity: channel", "granularity: row"))
    (tmp_path / "good.yaml").write_text(E5M2_TEXT)
    catalog, messages = skipping(monkeypatch, tmp_path)
    assert "test/fp8-e5m2-weight-only" in catalog
    (message,) = messages
    assert re.match(rf"skipped {re.escape(str(tmp_path))}/bad\.yaml:7:18: weight\.scale\.granularity: 'row'", message)
    assert re.search(r"bad\.yaml:7:18: weight\.scale\.granularity: 'row'", strict_error(monkeypatch))


def test_a_file_with_several_problems_is_one_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = E5M2_TEXT.replace("granularity: channel", "granularity: row").replace("stored: multiplier", "stored: x")
    (tmp_path / "bad.yaml").write_text(text)
    catalog, messages = skipping(monkeypatch, tmp_path)
    (message,) = messages
    assert message.startswith(f"skipped {tmp_path / 'bad.yaml'}: 2 problems\n  {tmp_path / 'bad.yaml'}:7:18: ")
    assert len(catalog.skipped) == 2


def test_missing_folder_on_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    catalog, messages = skipping(monkeypatch, tmp_path / "nowhere")
    assert "compressed-tensors/NVFP4" in catalog
    assert messages[0].startswith(
        f"skipped {tmp_path / 'nowhere'}: QSCHEME_SCHEME_PATH names this path, which does not"
    )
    (tmp_path / "file").write_text("")
    _, messages = skipping(monkeypatch, tmp_path / "file")
    assert "which is not a folder" in messages[0]
    assert "which is not a folder" in strict_error(monkeypatch)


def test_special_files_on_the_path_are_reported_never_opened(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    os.mkfifo(tmp_path / "pipe.yaml")  # opening it would block until a writer comes
    (tmp_path / "dangling.yaml").symlink_to(tmp_path / "gone.yaml")
    (tmp_path / "loop.yaml").symlink_to(tmp_path / "loop.yaml")
    (tmp_path / "huge.yaml").write_bytes(b"#" * (2 << 20))
    (tmp_path / "good.yaml").write_text(E5M2_TEXT)
    (tmp_path / "notes.txt").symlink_to(tmp_path / "gone.txt")  # not a descriptor name: not looked at
    catalog, messages = skipping(monkeypatch, tmp_path)
    assert "test/fp8-e5m2-weight-only" in catalog
    by_file = {message.split(": ")[0].removeprefix("skipped "): message for message in messages}
    assert set(by_file) == {str(tmp_path / n) for n in ("pipe.yaml", "dangling.yaml", "loop.yaml", "huge.yaml")}
    assert "is a FIFO (named pipe), not a descriptor file" in by_file[str(tmp_path / "pipe.yaml")]
    assert (
        f"is a symlink to {str(tmp_path / 'gone.yaml')!r}, which does not exist"
        in by_file[str(tmp_path / "dangling.yaml")]
    )
    assert "is a symlink loop" in by_file[str(tmp_path / "loop.yaml")]
    assert f"is {2 << 20} bytes; a descriptor is at most 1048576 bytes" in by_file[str(tmp_path / "huge.yaml")]
    error = strict_error(monkeypatch)
    assert all(name in error for name in ("pipe.yaml", "dangling.yaml", "loop.yaml", "huge.yaml"))


def test_a_symlinked_folder_is_read_and_a_loop_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (real / "e5m2.yaml").write_text(E5M2_TEXT)
    top = tmp_path / "top"
    top.mkdir()
    (top / "linked").symlink_to(real)
    (real / "back").symlink_to(top)  # top -> linked (real) -> back (top): a loop
    catalog, messages = skipping(monkeypatch, top)
    assert catalog.get("test/fp8-e5m2-weight-only").path == str(top / "linked" / "e5m2.yaml")
    (message,) = messages
    assert (
        f"skipped {top / 'linked' / 'back'}: is a symlink to {str(top)!r}, a folder that contains this link (a loop)"
        in message
    )


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
    catalog, messages = skipping(monkeypatch, tmp_path)
    assert "test/fp8-e5m2-weight-only" in catalog
    expected = (
        f"{locked}: cannot read this scheme folder: Permission denied; make it readable (chmod +rx), or move it away"
    )
    assert messages == [f"skipped {expected}\n  (the other schemes load; QSCHEME_STRICT_SCHEMES=1 makes this an error)"]
    assert strict_error(monkeypatch) == expected
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
    _, messages = skipping(monkeypatch, tmp_path)
    assert re.search(r"bad\.yaml:11:15: not valid YAML: character U\+0000 is not allowed", messages[0])


@pytest.mark.parametrize(
    "text",
    ["name: " + "[" * 5000 + "]" * 5000 + "\n", E5M2_TEXT.replace("[N, K]", "[N, " + "9" * 5000 + "]")],
    ids=["deep", "5000 digits"],
)
def test_yaml_python_cannot_read_is_a_scheme_error(text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "bad.yaml").write_text(text)
    _, messages = skipping(monkeypatch, tmp_path)
    assert re.match(rf"^skipped {re.escape(str(tmp_path / 'bad.yaml'))}:\d+:\d+: ", messages[0])
    monkeypatch.setenv("QSCHEME_STRICT_SCHEMES", "1")
    with pytest.raises(SchemeError, match=rf"^{re.escape(str(tmp_path / 'bad.yaml'))}:\d+:\d+: "):
        load_catalog(include_plugins=False)


def test_a_broken_builtin_is_always_an_error(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text(E5M2_TEXT.replace("granularity: channel", "granularity: row"))
    with pytest.raises(SchemeError, match="'row'"):
        build_catalog([("builtin", tmp_path / "bad.yaml")], strict=False)
    assert len(build_catalog([("path:x", tmp_path / "bad.yaml")], strict=False).skipped) == 1


@pytest.mark.parametrize("kind", ["fifo", "device", "huge", "dangling"])
def test_load_scheme_refuses_what_is_not_a_descriptor_file(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "huge":
        path.write_bytes(b"#" * ((1 << 20) + 1))
    elif kind == "dangling":
        path.symlink_to(tmp_path / "gone.yaml")
    target = "/dev/zero" if kind == "device" else str(path)
    expected = {
        "fifo": "is a FIFO (named pipe), not a descriptor file",
        "device": "is a character device, not a descriptor file",
        "huge": "is 1048577 bytes; a descriptor is at most 1048576 bytes",
        "dangling": "is a symlink to",
    }[kind]
    with pytest.raises(SchemeNotFoundError, match=re.escape(f"{target}: {expected}")):
        load_scheme(target)


def test_strict_lists_every_problem_of_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    os.mkfifo(tmp_path / "pipe.yaml")
    (tmp_path / "dangling.yaml").symlink_to(tmp_path / "gone.yaml")
    (tmp_path / "loop1.yaml").symlink_to(tmp_path / "loop2.yaml")
    (tmp_path / "loop2.yaml").symlink_to(tmp_path / "loop1.yaml")
    (tmp_path / "broken.yaml").write_text("name: acme/broken\nweight: [\n")
    case = (BUILTIN / "modelopt" / "FP8.yaml").read_text().replace("name: modelopt/FP8", "name: ModelOpt/fp8", 1)
    (tmp_path / "case.yaml").write_text(case.replace("quant_algo: FP8", "quant_algo: OTHER_FP8", 1))
    (tmp_path / "good.yaml").write_text(E5M2_TEXT)
    names = ("pipe.yaml", "dangling.yaml", "loop1.yaml", "loop2.yaml", "broken.yaml", "case.yaml")
    catalog, messages = skipping(monkeypatch, tmp_path)
    assert len(messages) == len(names)
    assert {problem.location.file for problem in catalog.skipped} == {str(tmp_path / name) for name in names}
    error = strict_error(monkeypatch)  # the same six, in one error: not only the unreadable files
    assert sorted(line.split(":")[0] for line in error.splitlines()) == sorted(str(tmp_path / n) for n in names)
    assert "broken.yaml:3:1: not valid YAML" in error and "differs only by case from 'modelopt/FP8'" in error


def loads_silently(monkeypatch: pytest.MonkeyPatch, *folders: Path) -> Catalog:
    """The catalog with ``folders`` on QSCHEME_SCHEME_PATH, which must give no warning."""
    monkeypatch.setenv("QSCHEME_SCHEME_PATH", os.pathsep.join(str(folder) for folder in folders))
    monkeypatch.delenv("QSCHEME_STRICT_SCHEMES", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        catalog = load_catalog(include_plugins=False)
    assert catalog.skipped == ()
    return catalog


def test_a_file_reached_through_two_path_entries_is_read_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inner = tmp_path / "acme"
    inner.mkdir()
    (inner / "mine.yaml").write_text(E5M2_TEXT)
    catalog = loads_silently(monkeypatch, tmp_path, inner)  # one entry inside the other
    scheme = catalog.get("test/fp8-e5m2-weight-only")
    assert (scheme.path, scheme.source) == (str(inner / "mine.yaml"), f"path:{tmp_path}")
    assert loads_silently(monkeypatch, inner, tmp_path).get(scheme.name).source == f"path:{inner}"
    other = tmp_path.parent / f"{tmp_path.name}-other"  # an entry with a symlink into the first one
    other.mkdir()
    (other / "link").symlink_to(inner)
    (other / "same.yaml").symlink_to(inner / "mine.yaml")
    catalog = loads_silently(monkeypatch, inner, other)
    assert catalog.get(scheme.name).path == str(inner / "mine.yaml")
    assert descriptor_files(other) == [other / "link" / "mine.yaml"]  # one file under two names: listed once


def test_a_link_to_a_sibling_folder_is_not_a_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "mine.yaml").write_text(E5M2_TEXT)
    (tmp_path / "b" / "alias").symlink_to(Path("..") / "a")
    catalog = loads_silently(monkeypatch, tmp_path)
    assert catalog.get("test/fp8-e5m2-weight-only").path == str(tmp_path / "a" / "mine.yaml")
    assert descriptor_files(tmp_path) == [tmp_path / "a" / "mine.yaml"]
    (tmp_path / "b" / "up").symlink_to("..")  # a link to a folder that holds it: a loop
    _, messages = skipping(monkeypatch, tmp_path)
    assert [message.split("\n")[0] for message in messages] == [
        f"skipped {tmp_path / 'b' / 'up'}: is a symlink to '..', a folder that contains this link (a loop); it is "
        "not read; remove the link"
    ]


@pytest.mark.parametrize(
    ("name", "suggested"),
    [
        ("NVFP4A16", ["compressed-tensors/NVFP4A16"]),  # llm-compressor's preset name, no producer
        ("w4a16", ["compressed-tensors/W4A16", "gptq/W4A16", "gptq_v2/W4A16"]),
        ("FP8", ["compressed-tensors/FP8", "modelopt/FP8"]),
        ("fp8_pb_wo", ["modelopt/fp8_pb_wo"]),
        ("llmcompressor/NVFP4A16", ["compressed-tensors/NVFP4A16"]),  # another producer's prefix
        ("NVFP4", ["compressed-tensors/NVFP4", "gguf/NVFP4", "modelopt/NVFP4"]),
        ("q4_k", ["gguf/Q4_K"]),
        # a typo after no prefix
        ("W4A16_ASYMM", ["awq/W4A16_ASYM", "compressed-tensors/W4A16_ASYM", "gptq/W4A16_ASYM", "gptq_v2/W4A16_ASYM"]),
    ],
)
def test_a_preset_name_without_its_producer_gets_suggestions(name: str, suggested: list[str]) -> None:
    catalog = load_catalog(include_plugins=False)
    assert catalog.suggestions(name) == suggested
    with pytest.raises(SchemeError) as caught:
        catalog.get(name)
    message = str(caught.value)
    assert "Did you mean " + " or ".join(repr(s) for s in suggested) + "?" in message
    assert ("Scheme names start with their producer" in message) == ("/" not in name)


def test_an_unrelated_name_gets_no_suggestion() -> None:
    with pytest.raises(SchemeError) as caught:
        load_catalog(include_plugins=False).get("xyz")
    assert "Did you mean" not in str(caught.value)


def test_the_command_line_suggests_the_producer(capsys: pytest.CaptureFixture[str]) -> None:
    from qscheme.cli.main import main

    assert main(["show", "NVFP4A16"]) == 2
    assert "Did you mean 'compressed-tensors/NVFP4A16'?" in capsys.readouterr().err
