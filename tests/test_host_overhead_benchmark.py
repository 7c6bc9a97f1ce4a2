"""benchmarks/host_overhead.py: it times the Triton host path with the launches stubbed, for
every scheme and M, without a GPU (--smoke: a few calls)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "host_overhead.py"


@pytest.mark.subprocess
def test_smoke_times_every_scheme_and_m() -> None:
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    schemes = ("compressed-tensors/NVFP4A16", "compressed-tensors/NVFP4")
    arguments = [argument for name in schemes for argument in ("--scheme", name)]
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", *arguments],
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    rows = re.findall(r"^\| (\S+) \| (\d+) \| (\d+) \| ([\d.]+) \| ([\d.]+)x \|$", completed.stdout, re.MULTILINE)
    assert [(name, int(m)) for name, m, *_ in rows] == [(name, m) for name in schemes for m in (1, 16, 256)]
    launches = {(name, int(m)): int(count) for name, m, count, *_ in rows}
    # weight-only decode: the GEMM and its split-K epilogue; W4A4 adds the activation pre-pass
    assert launches[("compressed-tensors/NVFP4A16", 1)] == 2
    assert launches[("compressed-tensors/NVFP4", 1)] == 3
    assert all(float(us) > 0 for *_, us, _ in rows)
    assert re.search(r"QuantLinear.forward around its kernel: -?[\d.]+ us", completed.stdout)


def test_gpu_mode_table_runs_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """--gpu's eager timing, run on the CPU under the interpreter at a tiny shape: the table it
    prints on a GPU (its times mean nothing here)."""
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))
    spec = importlib.util.spec_from_file_location("_host_overhead", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # pops TRITON_INTERPRET (for its own runs): put it back
    os.environ["TRITON_INTERPRET"] = "1"
    text = module.gpu_eager(["compressed-tensors/NVFP4A16", "compressed-tensors/W4A16"], 2, "cpu", 64, 64)
    rows = re.findall(
        r"^\| (\S+) \| ([\d.]+) \| ([\d.]+) \| (-?[\d.]+) \| ([\d.]+) \| ([\d.]+)x \|$", text, re.MULTILINE
    )
    assert [row[0] for row in rows] == ["compressed-tensors/NVFP4A16", "compressed-tensors/W4A16"]
    for _, total, host, rest, _, _ in rows:  # the stubbed calls' time and the rest make the whole
        assert abs(float(host) + float(rest) - float(total)) <= 0.15
        assert float(host) < float(total)  # stubbed: no interpreted kernel runs (milliseconds each)
    assert "Eager calls at M=1, 64x64, bf16 inputs, on the CPU (Triton interpreter):" in text


@pytest.mark.subprocess
def test_gpu_mode_without_cuda_exits_2() -> None:
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--gpu"], env=environment, capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 2
    assert "needs a CUDA GPU" in completed.stderr
