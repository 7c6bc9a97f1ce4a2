"""OutputFolder: refusals before writing, the temporary folder beside DST, commit, cleanup, stale folders."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from qscheme.errors import OutputError
from qscheme.storage import OutputFolder, Terminated, raise_on_termination


def test_commit_renames_the_partial_folder_into_place(tmp_path: Path) -> None:
    with OutputFolder(tmp_path / "dst", force=False, sources=[tmp_path / "src"]) as out:
        assert out.path.parent == tmp_path and out.path.name.startswith(".dst.qscheme-partial-")
        (out.path / "a.txt").write_text("a")
        assert not (tmp_path / "dst").exists()
        out.commit()
    assert (tmp_path / "dst" / "a.txt").read_text() == "a"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


def test_an_exception_removes_the_partial_folder(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), OutputFolder(tmp_path / "dst", force=False, sources=[]) as out:
        (out.path / "a.txt").write_text("a")
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_refusals_happen_before_anything_is_written(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (tmp_path / "dst").mkdir()
    with pytest.raises(OutputError, match=r"already exists.*--force"):
        OutputFolder(tmp_path / "dst", force=False, sources=[src])
    with pytest.raises(OutputError, match="would be the source"):
        OutputFolder(src, force=True, sources=[src])
    with pytest.raises(OutputError, match="inside the source"):
        OutputFolder(src / "out", force=False, sources=[src])
    with pytest.raises(OutputError, match="contains the source"):
        OutputFolder(tmp_path, force=True, sources=[src])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]


def test_force_replaces_only_after_the_new_folder_is_complete(tmp_path: Path) -> None:
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), OutputFolder(tmp_path / "dst", force=True, sources=[]) as out:
        raise RuntimeError("failed mid-write")
    assert (tmp_path / "dst" / "old.txt").read_text() == "old"  # a failed run keeps the old DST
    with OutputFolder(tmp_path / "dst", force=True, sources=[]) as out:
        (out.path / "new.txt").write_text("new")
        out.commit()
    assert sorted(p.name for p in (tmp_path / "dst").iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


_LEAVE_PARTIAL = """
import os, sys, time
from qscheme.storage import OutputFolder
out = OutputFolder(sys.argv[1], force=False, sources=[]).__enter__()
print(out.path, flush=True)
if sys.argv[2] == "die":
    os._exit(0)  # no cleanup, as after SIGKILL
time.sleep(600)
"""


def _leave_partial(dst: Path, mode: str) -> tuple[Path, subprocess.Popen[str]]:
    process = subprocess.Popen(
        [sys.executable, "-c", _LEAVE_PARTIAL, str(dst), mode], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    return Path(process.stdout.readline().strip()), process


@pytest.mark.subprocess
def test_stale_partial_folders_of_dead_processes_are_removed(tmp_path: Path) -> None:
    alive, running = _leave_partial(tmp_path / "dst", "live")  # a live process: left alone
    stale, dead = _leave_partial(tmp_path / "dst", "die")
    dead.wait(timeout=60)
    try:
        assert stale.is_dir() and alive.is_dir()
        with OutputFolder(tmp_path / "dst", force=False, sources=[]) as out:
            out.commit()
        assert not stale.exists() and alive.exists()
    finally:
        running.kill()
        running.wait(timeout=60)


def test_sigterm_raises_terminated_inside_the_block() -> None:
    with pytest.raises(Terminated, match="SIGTERM"), raise_on_termination():
        os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
