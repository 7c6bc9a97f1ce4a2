"""Writing is safe whatever the source holds (issue 24, point 8).

Each point: colliding tensor names, other files (links in and out, FIFOs, devices, loops, size),
``--force`` next to a source that links into DST, an atomic forced commit, temporary folders
owned by their run, every output planned by the loader before the commit, boolean flags only,
calibration values checked, and ``re:`` ignore entries through the loader's backtracking guard.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_writing_source import llama_tensors, write_source_checkpoint

import qscheme
from qscheme.errors import DestinationError, QSchemeError, UsageError
from qscheme.storage import OLD_MARK, OWNER_FILE, PARTIAL_MARK, OutputFolder, Terminated, raise_on_termination
from qscheme.writing.calibration import CALIBRATION_FORMAT, Calibration, CalibrationError
from qscheme.writing.convert import convert_checkpoint
from qscheme.writing.loads_back import NameCollisionError, check_loads_back
from qscheme.writing.other_files import SIZE_VARIABLE, SourceFileError
from qscheme.writing.quantize import quantize_checkpoint

SCHEME = "compressed-tensors/W4A16"


def tree_digest(folder: Path) -> str:
    """Names, kinds, link targets and file bytes of everything under ``folder`` (no link followed)."""
    sha = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        sha.update(str(path.relative_to(folder)).encode())
        if path.is_symlink():
            sha.update(b"link:" + os.readlink(path).encode())
        elif path.is_file():
            sha.update(path.read_bytes())
    return sha.hexdigest()


def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(entry.name for entry in parent.iterdir() if entry.name.lstrip(".").startswith(name))


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return write_source_checkpoint(tmp_path / "src", llama_tensors(num_layers=1))


# --- names ------------------------------------------------------------------------------------


def test_a_source_tensor_named_like_a_produced_one_is_refused(tmp_path: Path) -> None:
    tensors = llama_tensors(num_layers=1)
    tensors["model.layers.0.self_attn.q_proj.weight_scale"] = torch.ones(128, 1, dtype=torch.bfloat16)
    source = write_source_checkpoint(tmp_path / "src", tensors)
    before = tree_digest(source)
    with pytest.raises(NameCollisionError) as caught:
        quantize_checkpoint(source, tmp_path / "dst", SCHEME)
    message = str(caught.value)
    assert "'model.layers.0.self_attn.q_proj.weight_scale'" in message and "model.layers.0.self_attn.q_proj" in message
    assert "--ignore" in message and leftovers(tmp_path, "dst") == [] and tree_digest(source) == before
    # ignored, the module is copied with the stray tensor, which the loader reads as a quantized
    # module the config ignores: the load-back check refuses it before the commit
    with pytest.raises(DestinationError, match=r"does not load back.*stores quantized tensors"):
        quantize_checkpoint(source, tmp_path / "dst", SCHEME, ignore=["lm_head", "model.layers.0.self_attn.q_proj"])
    assert leftovers(tmp_path, "dst") == [] and tree_digest(source) == before


def test_convert_refuses_a_stray_tensor_named_like_a_produced_one(tmp_path: Path) -> None:
    from checkpoint_cache import modelopt_fixture
    from safetensors.torch import load_file

    source = tmp_path / "src"
    shutil.copytree(modelopt_fixture("nvfp4"), source, ignore=shutil.ignore_patterns("reference.safetensors"))
    tensors = load_file(str(source / "model.safetensors"))
    # compressed-tensors NVFP4 writes weight_packed for each quantized module; a stray one in the source
    tensors["model.layers.0.mlp.up_proj.weight_packed"] = torch.zeros(4, dtype=torch.uint8)
    save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})
    before = tree_digest(source)
    with pytest.raises(QSchemeError) as caught:
        convert_checkpoint(source, tmp_path / "dst", "compressed-tensors/NVFP4")
    assert "model.layers.0.mlp.up_proj.weight_packed" in str(caught.value)
    assert leftovers(tmp_path, "dst") == [] and tree_digest(source) == before


# --- other files ------------------------------------------------------------------------------


def test_links_inside_the_source_are_copied_as_files(src: Path, tmp_path: Path) -> None:
    (src / "extra").mkdir()
    (src / "extra" / "vocab.txt").write_text("a b c")
    (src / "vocab_link.txt").symlink_to("extra/vocab.txt")
    quantize_checkpoint(src, tmp_path / "dst", SCHEME)
    copied = tmp_path / "dst" / "vocab_link.txt"
    assert not copied.is_symlink() and copied.read_text() == "a b c"
    assert (tmp_path / "dst" / "extra" / "vocab.txt").read_text() == "a b c"


def test_hugging_face_cache_links_into_blobs_are_copied(tmp_path: Path) -> None:
    repo = tmp_path / "models--org--tiny"
    snapshot = write_source_checkpoint(repo / "snapshots" / "abc123", llama_tensors(num_layers=1))
    (repo / "blobs").mkdir()
    (repo / "blobs" / "f00d").write_text('{"chat_template": "x"}')
    (snapshot / "tokenizer_config.json").symlink_to("../../blobs/f00d")
    quantize_checkpoint(snapshot, tmp_path / "dst", SCHEME)
    assert (tmp_path / "dst" / "tokenizer_config.json").read_text() == '{"chat_template": "x"}'


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda src, outside: (src / "secret.txt").symlink_to(outside / "secret.txt"), "outside the checkpoint"),
        (lambda src, outside: (src / "zeros").symlink_to("/dev/zero"), "outside the checkpoint"),
        (lambda src, outside: os.mkfifo(src / "pipe"), "FIFO"),
        (lambda src, outside: (src / "loop").symlink_to("."), "not a regular file"),
        (lambda src, outside: (src / "up").symlink_to(".."), "outside the checkpoint"),
        (lambda src, outside: (src / "dangling").symlink_to("missing.txt"), "cannot be read"),
        (
            lambda src, outside: (
                (src / "sub").mkdir() or (src / "sub" / "pipe").symlink_to("../pipe2") or os.mkfifo(src / "pipe2")
            ),
            "FIFO",
        ),
    ],
    ids=["link-out", "device-link", "fifo", "folder-loop", "parent-link", "dangling", "nested-fifo-link"],
)
def test_unsafe_other_files_are_refused_before_anything_is_written(src: Path, tmp_path: Path, make, said: str) -> None:  # type: ignore[no-untyped-def]
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("not the model's")
    make(src, outside)
    before = tree_digest(src)
    started = time.perf_counter()
    with pytest.raises(SourceFileError, match=said) as caught:
        quantize_checkpoint(src, tmp_path / "dst", SCHEME)
    assert time.perf_counter() - started < 30
    assert str(src) in str(caught.value) and "nothing was written" in str(caught.value)
    assert leftovers(tmp_path, "dst") == [] and tree_digest(src) == before


def test_the_size_bound_for_other_files_is_enforced_and_can_be_set(
    src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (src / "notes.bin").write_bytes(b"x" * 5000)
    monkeypatch.setenv(SIZE_VARIABLE, "4096")
    with pytest.raises(SourceFileError, match=r"notes\.bin: 5000 bytes, over the 4096-byte bound"):
        quantize_checkpoint(src, tmp_path / "dst", SCHEME)
    assert leftovers(tmp_path, "dst") == []
    monkeypatch.setenv(SIZE_VARIABLE, "lots")
    with pytest.raises(UsageError, match=SIZE_VARIABLE):
        quantize_checkpoint(src, tmp_path / "dst", SCHEME)
    monkeypatch.setenv(SIZE_VARIABLE, "5000")
    quantize_checkpoint(src, tmp_path / "dst", SCHEME)
    assert (tmp_path / "dst" / "notes.bin").stat().st_size == 5000


# --- --force and the commit -------------------------------------------------------------------


def test_force_refuses_to_replace_what_the_source_links_into(tmp_path: Path) -> None:
    """The Hugging Face cache layout: the snapshot's weights are links into another folder; with
    that folder as DST, --force would delete the source's weights."""
    blobs = write_source_checkpoint(tmp_path / "blobs", llama_tensors(num_layers=1))
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for entry in blobs.iterdir():
        if entry.suffix == ".safetensors" or entry.name == "config.json":
            (snapshot / entry.name).symlink_to(entry)  # the weights and config: read where they are
        else:
            shutil.copyfile(entry, snapshot / entry.name)
    before = tree_digest(blobs)
    with pytest.raises(DestinationError, match=r"resolves to .*inside the output folder"):
        quantize_checkpoint(snapshot, blobs, SCHEME, force=True)
    assert tree_digest(blobs) == before and leftovers(tmp_path, "blobs") == ["blobs"]
    quantize_checkpoint(snapshot, tmp_path / "elsewhere", SCHEME, force=True)  # another DST is fine


def test_a_failed_forced_commit_puts_the_old_output_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    real_replace = os.replace

    def failing(source: object, target: object) -> None:
        if PARTIAL_MARK in str(source):
            raise OSError(28, "No space left on device")
        real_replace(source, target)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(DestinationError) as caught, OutputFolder(dst, force=True, sources=[]) as out:
        (out.path / "new.txt").write_text("new")
        out.commit()
    assert "previous output is back in place" in str(caught.value)
    assert sorted(p.name for p in dst.iterdir()) == ["old.txt"] and leftovers(tmp_path, "dst") == ["dst"]


def test_a_signal_during_a_forced_commit_is_held_until_the_commit_is_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    real_replace = os.replace

    def signal_between(source: object, target: object) -> None:
        real_replace(source, target)  # type: ignore[arg-type]
        if OLD_MARK in str(target):  # DST moved aside, the new folder not yet in: the worst moment
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(os, "replace", signal_between)
    with pytest.raises(Terminated) as caught, raise_on_termination(), OutputFolder(dst, force=True, sources=[]) as out:
        (out.path / "new.txt").write_text("new")
        out.commit()
    assert caught.value.committed == dst  # the CLI says the checkpoint is in place, not "nothing written"
    assert sorted(p.name for p in dst.iterdir()) == ["new.txt"] and leftovers(tmp_path, "dst") == ["dst"]


# --- temporary folders ------------------------------------------------------------------------


def test_only_this_runs_folder_and_dead_runs_of_this_machine_are_removed(tmp_path: Path) -> None:
    no_record = tmp_path / f".dst{PARTIAL_MARK}1-0123456789ab"  # someone's folder without an owner record
    no_record.mkdir()
    other_namespace = tmp_path / f".dst{PARTIAL_MARK}2-0123456789ab"
    other_namespace.mkdir()
    record = {"pid": 2, "start_time": "1", "boot_id": "x", "pid_namespace": "pid:[1]", "token": "2-0123456789ab"}
    (other_namespace / OWNER_FILE).write_text(json.dumps(record))
    similar = tmp_path / f".dst{PARTIAL_MARK}3-0123456789ab.mine"  # not exactly the pattern
    similar.mkdir()
    another_dst = tmp_path / f".dst2{PARTIAL_MARK}4-0123456789ab"
    another_dst.mkdir()
    with pytest.raises(RuntimeError), OutputFolder(tmp_path / "dst", force=False, sources=[]) as out:
        mine = out.path
        assert mine.name.startswith(f".dst{PARTIAL_MARK}{os.getpid()}-") and (mine / OWNER_FILE).exists()
        raise RuntimeError("failed")
    assert not mine.exists()
    assert all(path.is_dir() for path in (no_record, other_namespace, similar, another_dst))


# --- loads back -------------------------------------------------------------------------------


def test_wildcards_with_several_stars_write_a_checkpoint_that_loads(src: Path, tmp_path: Path) -> None:
    ignore = ["lm_head", "*a*t*n*", "*.*.*.*.gate_proj"]
    summary = quantize_checkpoint(src, tmp_path / "dst", SCHEME, ignore=ignore)
    quantized = {row.name for row in summary.layers if row.action == "quantized"}
    assert quantized == {"model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"}
    assert set(qscheme.load_checkpoint(tmp_path / "dst").modules) == quantized
    written = json.loads((tmp_path / "dst" / "config.json").read_text())["quantization_config"]["ignore"]
    assert "model.layers.0.self_attn.q_proj" in written  # as the module names the guard-refused wildcard matched


def test_check_loads_back_refuses_a_folder_the_loader_plans_otherwise(src: Path, tmp_path: Path) -> None:
    quantize_checkpoint(src, tmp_path / "dst", SCHEME)
    layers = set(qscheme.load_checkpoint(tmp_path / "dst").modules)
    check_loads_back(tmp_path / "dst", layers, SCHEME)
    with pytest.raises(DestinationError, match="other quantized modules"):
        check_loads_back(tmp_path / "dst", layers | {"model.layers.9.mlp.up_proj"}, SCHEME)
    with pytest.raises(DestinationError, match="reads back as"):
        check_loads_back(tmp_path / "dst", layers, "compressed-tensors/W8A16")
    (tmp_path / "dst" / "config.json").write_text("{")
    with pytest.raises(DestinationError, match="does not load back"):
        check_loads_back(tmp_path / "dst", layers, SCHEME)


def test_tiny_weights_give_a_checkpoint_that_loads_or_a_refusal_naming_the_layer(tmp_path: Path) -> None:
    tensors = llama_tensors(num_layers=1, dtype=torch.float32)
    for scale in (1e-36, 1e-40, 1e-44):
        tensors["model.layers.0.self_attn.q_proj.weight"] = torch.full((128, 128), scale) * torch.linspace(-1, 1, 128)
        source = write_source_checkpoint(tmp_path / f"src{scale}", tensors)
        for scheme in ("modelopt/NVFP4", "compressed-tensors/NVFP4A16", "compressed-tensors/FP8_DYNAMIC"):
            dst = tmp_path / f"dst{scale}{scheme.replace('/', '_')}"
            calibration = {
                "format": CALIBRATION_FORMAT,
                "input_amax": {name[:-7]: 1.0 for name in tensors if name.endswith("proj.weight")},
            }
            try:
                quantize_checkpoint(source, dst, scheme, calibration=calibration)
            except QSchemeError as exc:
                assert "q_proj" in str(exc) and not dst.exists()
                continue
            for layer in qscheme.load_checkpoint(dst).modules.values():
                assert bool(torch.isfinite(layer.dequantize()).all())


# --- flags, calibration, patterns -------------------------------------------------------------


@pytest.mark.parametrize("flag", [{"force": "no"}, {"force": 0}, {"progress": "yes"}])
def test_flags_take_booleans_only(src: Path, tmp_path: Path, flag: dict[str, object]) -> None:
    with pytest.raises(UsageError, match=f"{next(iter(flag))} must be True"):
        quantize_checkpoint(src, tmp_path / "dst", SCHEME, **flag)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=f"{next(iter(flag))} must be True"):
        convert_checkpoint(src, tmp_path / "dst", "compressed-tensors/W4A16", **flag)  # type: ignore[arg-type]
    assert leftovers(tmp_path, "dst") == []


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (float("nan"), "NaN"),
        (-1.0, "-1.0"),
        ("3.2", '"3.2"'),
        ([1.0, 2.0], "[1.0, 2.0]"),
        (True, "true"),
        (1e39, "1e+39"),
        (1e-39, "1e-39"),
        (1e-37, "not a finite normal float32"),
    ],
)
def test_bad_calibration_values_name_the_file_and_key(src: Path, tmp_path: Path, value: object, said: str) -> None:
    modules = [name[:-7] for name in llama_tensors(num_layers=1) if name.endswith("proj.weight")]
    amax: dict[str, object] = dict.fromkeys(modules, 1.0)
    amax["model.layers.0.self_attn.k_proj"] = value
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"format": CALIBRATION_FORMAT, "input_amax": amax}))
    with pytest.raises(CalibrationError) as caught:
        quantize_checkpoint(src, tmp_path / "dst", "compressed-tensors/FP8", calibration=path)
    message = str(caught.value)
    assert str(path) in message and "'model.layers.0.self_attn.k_proj'" in message and said in message
    assert leftovers(tmp_path, "dst") == []


def test_calibration_built_directly_is_checked() -> None:
    with pytest.raises(CalibrationError, match="not a module name"):
        Calibration("mine", {3: 1.0})  # type: ignore[dict-item]
    with pytest.raises(CalibrationError, match=r"mine: input_amax\['a'\] is NaN"):
        Calibration("mine", {"a": float("nan")})
    with pytest.raises(CalibrationError, match="must be a mapping"):
        Calibration("mine", [("a", 1.0)])  # type: ignore[arg-type]


def test_a_backtracking_ignore_pattern_is_refused_quickly(tmp_path: Path) -> None:
    tensors = {"model." + "a" * 27 + "b.weight": torch.randn(64, 128, dtype=torch.bfloat16)}
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.randn(128, 128, dtype=torch.bfloat16)
    source = write_source_checkpoint(tmp_path / "src", tensors)
    started = time.perf_counter()
    entry = r"re:model\.(a+)+$"
    with pytest.raises(UsageError, match=re.escape(f"{entry!r} is refused")):
        quantize_checkpoint(source, tmp_path / "dst", SCHEME, ignore=[entry])
    assert time.perf_counter() - started < 5 and leftovers(tmp_path, "dst") == []


def test_the_cli_says_what_is_on_disk_after_a_signal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from qscheme.cli.writes import run_write

    def stopped(committed: Path | None):  # type: ignore[no-untyped-def]
        def write(progress: bool | None) -> None:
            stop = Terminated(signal.SIGTERM)
            stop.committed = committed
            raise stop

        return write

    assert run_write("quantize", str(tmp_path / "dst"), stopped(None), as_json=False) == 128 + signal.SIGTERM
    assert "nothing was written to" in capsys.readouterr().err
    assert run_write("quantize", str(tmp_path / "dst"), stopped(tmp_path / "dst"), as_json=False) == 143
    err = capsys.readouterr().err
    assert "already complete and in place" in err and "nothing was written" not in err
