"""benchmarks/gpu_gemm.py runs end to end on the CPU (--smoke, Triton interpreter) and, without
--smoke, stops with a clear message where no CUDA GPU is visible."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "gpu_gemm.py"


def _run(*arguments: str) -> subprocess.CompletedProcess[str]:
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *arguments], env=environment, capture_output=True, text=True, timeout=300
    )


def test_smoke_run_prints_the_table(tmp_path: Path) -> None:
    markdown = tmp_path / "table.md"
    completed = _run("--smoke", "--markdown", str(markdown))
    assert completed.returncode == 0, completed.stderr[-2000:]
    text = markdown.read_text()
    assert "| M | N x K | triton us | bf16 us | speedup |" in text
    assert "| 1 | 64x128 |" in text and "| 4 | 96x160 |" in text
    assert "Largest error against the reference kernel" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the script would benchmark it")
def test_without_a_gpu_it_says_so() -> None:
    completed = _run()
    assert completed.returncode == 2
    assert "no CUDA GPU is visible" in completed.stderr and "--smoke" in completed.stderr
