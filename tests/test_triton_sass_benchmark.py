"""benchmarks/triton_sass.py runs on the CPU: it compiles the decode GEMM for a GPU target,
reads its K loop, and compares a git revision compiled in a worktree in the same run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "triton_sass.py"


def _run(tmp_path: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    environment["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    command = [sys.executable, str(SCRIPT), "--scheme", "compressed-tensors/NVFP4A16", "--targets", "sm90", *arguments]
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600, cwd=tmp_path)


def test_json_rows_describe_the_decode_loop(tmp_path: Path) -> None:
    completed = _run(tmp_path, "--json")
    assert completed.returncode == 0, completed.stderr[-3000:]
    (row,) = json.loads(completed.stdout)
    assert (row["scheme"], row["target"]) == ("compressed-tensors/NVFP4A16", "sm90")
    assert row["tile"].startswith("16x64x128")
    assert row["mma"] > 0 and row["instructions"] > row["mma"]
    assert row["global_loads"] == 0
    assert row["per_1k_weights"] == row["instructions"] * 4 * 1024 / (64 * 128)


def test_baseline_revision_is_compiled_beside_the_tree(tmp_path: Path) -> None:
    markdown = tmp_path / "table.md"
    completed = _run(tmp_path, "--baseline", "HEAD", "--markdown", str(markdown))
    assert completed.returncode == 0, completed.stderr[-3000:]
    text = markdown.read_text().splitlines()
    assert text[0].startswith("triton ")  # the version whose code generation was read
    lines = text[text.index("") + 1 :]
    assert "baseline HEAD: per 1K weights" in lines[0] and "ratio" in lines[0]
    cells = [cell.strip() for cell in lines[2].strip("|").split("|")]
    assert cells[:2] == ["compressed-tensors/NVFP4A16", "sm90"]
    assert cells[-1].endswith("x") and float(cells[-1][:-1]) > 0
    worktrees = subprocess.run(["git", "-C", str(SCRIPT.parent), "worktree", "list"], capture_output=True, text=True)
    assert "baseline" not in worktrees.stdout  # removed after the run
