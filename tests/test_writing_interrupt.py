"""An interrupted `qscheme quantize` leaves SRC untouched and no DST (SIGKILL, SIGTERM, SIGINT)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_writing_source import write_source_checkpoint

from qscheme.storage import PARTIAL_MARK

pytestmark = pytest.mark.subprocess

SHARDS = 6


def _big_source(folder: Path) -> Path:
    """~190 MB of bf16 Linear weights in 6 shards: a few seconds of quantizing on two cores."""
    generator = torch.Generator().manual_seed(3)
    tensors = {}
    shards = []
    for shard in range(SHARDS):
        names = []
        for index in range(4):
            name = f"model.layers.{shard}.mlp.proj{index}.weight"
            tensors[name] = (torch.randn(2048, 2048, generator=generator) * 0.02).to(torch.bfloat16)
            names.append(name)
        shards.append(names)
    return write_source_checkpoint(folder, tensors, shards)


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    folder = _big_source(tmp_path_factory.mktemp("interrupt") / "src")
    return folder, _digest(folder)


def _start(src: Path, dst: Path) -> subprocess.Popen[bytes]:
    # SIGINT as a terminal delivers it: a process started in the background of a non-interactive
    # shell (a CI runner's `cmd &`) inherits SIGINT ignored, and Python then leaves it ignored
    code = (
        "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "from qscheme.cli.main import main; sys.exit(main(sys.argv[1:]))"
    )
    command = [sys.executable, "-c", code, "quantize", str(src), str(dst), "--scheme", "compressed-tensors/NVFP4A16"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def _wait_for_partial(parent: Path, process: subprocess.Popen[bytes]) -> Path:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = [p for p in parent.iterdir() if PARTIAL_MARK in p.name]
        if found and any(found[0].glob("*.safetensors")):
            return found[0]
        if process.poll() is not None:
            pytest.fail(f"quantize ended before it could be interrupted: {process.communicate()}")
        time.sleep(0.02)
    process.kill()
    pytest.fail("no partial folder appeared within 60 s")


@pytest.mark.parametrize("signal_number", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_interrupted_quantize_leaves_no_dst(
    tmp_path: Path, source: tuple[Path, dict[str, str]], signal_number: int
) -> None:
    src, digest = source
    dst = tmp_path / "dst"
    process = _start(src, dst)
    partial = _wait_for_partial(tmp_path, process)
    process.send_signal(signal_number)
    process.wait(timeout=60)
    assert process.returncode != 0
    assert not dst.exists()
    assert _digest(src) == digest
    if signal_number == signal.SIGKILL:
        assert partial.exists()  # nothing could clean up; the next run removes it
        rerun = _start(src, dst)
        _, err = rerun.communicate(timeout=300)
        assert rerun.returncode == 0, err.decode()
        assert not partial.exists() and (dst / "model.safetensors.index.json").exists()
    else:
        assert not partial.exists()
        expected = 128 + signal_number if signal_number == signal.SIGTERM else 130
        assert process.returncode == expected
