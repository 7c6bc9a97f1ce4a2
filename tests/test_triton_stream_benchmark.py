"""benchmarks/triton_stream.py: its kernel reads exactly the bytes the GEMM reads (--smoke,
interpreter), it compiles, pipelined through shared memory, for the GPUs it is meant for
(--compile-check, no GPU), and without --smoke it stops with a clear message where no CUDA GPU
is visible."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.subprocess

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "triton_stream.py"


def _run(*arguments: str, tmp_path: Path | None = None) -> subprocess.CompletedProcess[str]:
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    if tmp_path is not None:
        environment["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    return subprocess.run(
        [sys.executable, str(SCRIPT), *arguments], env=environment, capture_output=True, text=True, timeout=600
    )


def test_smoke_checks_every_loaded_byte() -> None:
    completed = _run("--smoke")
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert re.search(r"stream smoke: (\d+) checks, every stored XOR equals torch's", completed.stdout)


def test_compiles_for_hopper_with_its_loads_pipelined(tmp_path: Path) -> None:
    completed = _run("--compile-check", "sm90", tmp_path=tmp_path)
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]
    rows = re.findall(r"^ok\s+sm90\s+shared\s+(\d+) (.*)$", completed.stdout, re.MULTILINE)
    assert len(rows) >= 8, completed.stdout
    # staged tiles in shared memory: the loop's loads are issued stages ahead, as in the GEMM
    # (without tl.range's num_stages Triton leaves a loop with no dot unpipelined: 256 bytes)
    for shared, name in rows:
        assert int(shared) > 8192, (shared, name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the script would benchmark it")
def test_without_a_gpu_it_says_so() -> None:
    completed = _run()
    assert completed.returncode == 2
    assert "no CUDA GPU is visible" in completed.stderr and "--smoke" in completed.stderr
