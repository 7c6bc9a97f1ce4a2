"""The main-venv side of a side-venv oracle that runs jobs: find the oracle's Python (or skip),
and run a driver script in it on a JSON file of jobs, raising with its output when it fails.
Used by the oracles whose drivers read ``{"jobs": [...]}`` (tests/gptq_oracle.py,
tests/bitsandbytes_oracle.py)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def oracle_python(env: str, oracle: str) -> str:
    """``$env`` (the oracle venv's Python), or skip the calling test (CI always sets it)."""
    python = os.environ.get(env)
    if not python:
        import pytest

        pytest.skip(f"{env} is not set: run `bash scripts/oracle-venv.sh {oracle}` and export its bin/python")
    return python


def run_jobs(
    script: str,
    jobs: Sequence[Mapping[str, Any]],
    *,
    python: str,
    label: str,
    timeout: float = 600,
    extra_env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python script JOBS.json`` with ``{"jobs": jobs}``; RuntimeError naming ``label`` and
    showing the driver's output when it exits non-zero."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump({"jobs": [dict(job) for job in jobs]}, handle)
    try:
        completed = subprocess.run(
            [python, script, handle.name],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "PYTHONWARNINGS": "ignore", **(extra_env or {})},
        )
    finally:
        os.unlink(handle.name)
    if completed.returncode != 0:
        raise RuntimeError(f"the {label} oracle failed:\n{completed.stdout[-3000:]}\n{completed.stderr[-6000:]}")
    return completed


def references(folder: Path) -> dict[str, Any]:
    """The producer's own dequantization a job wrote beside its checkpoint: ``reference.safetensors``'s
    ``<module>.dequantized`` tensors, keyed by module name."""
    from safetensors.torch import load_file

    tensors = load_file(folder / "reference.safetensors")
    return {name.removesuffix(".dequantized"): value for name, value in tensors.items()}
