"""benchmarks/cpu_gemv_loops.py: the smoke run times each of cpu_gemv's loops that the layer and
this CPU run (the others left out as "-"), names the loop the extension takes by default, and
leaves the loops' switches as it found them. No assertion is on a time."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

from qscheme import cpu_gemv
from qscheme.catalog import load_scheme
from qscheme.triton.samples import random_weight

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
cpu_gemv_loops = importlib.import_module("cpu_gemv_loops")

pytestmark = pytest.mark.skipif(cpu_gemv.native() is None, reason="qscheme._cpu_gemv is not built")
SCHEMES = ("compressed-tensors/NVFP4A16", "compressed-tensors/W4A16", "compressed-tensors/W4A16_ASYM")


def test_the_smoke_run_times_the_loops_each_layer_runs(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QSCHEME_CPU_GEMV_INT16", "0")  # a switch set before the run, restored after it
    monkeypatch.delenv("QSCHEME_CPU_GEMV_BF16DOT", raising=False)
    threads = torch.get_num_threads()
    arguments = ["--smoke", "--threads", "1"]
    assert cpu_gemv_loops.main([*arguments, *(f"--scheme={name}" for name in SCHEMES)]) == 0
    assert torch.get_num_threads() == threads
    assert os.environ["QSCHEME_CPU_GEMV_INT16"] == "0" and "QSCHEME_CPU_GEMV_BF16DOT" not in os.environ
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| compressed-tensors/")]
    assert len(lines) == len(SCHEMES) * 4
    monkeypatch.delenv("QSCHEME_CPU_GEMV_INT16")
    for line in lines:
        name, shape, count, rows, default, float32, vnni, bf16, *ratios = (
            cell.strip() for cell in line.strip("|").split("|")
        )
        assert (shape, count) == ("64x256", "1")
        layout = cpu_gemv.layout_of(random_weight(load_scheme(name), 64, 256, seed=1, scale_dtype="bfloat16"))
        assert default == (cpu_gemv.dot_loop(layout, int(rows)) or "float32")
        assert float(float32) > 0  # the float32 loop runs every layer
        for loop, cell in (("vnni", vnni), ("bf16", bf16)):
            assert (cell != "-") == cpu_gemv_loops.runs(layout, loop, int(rows)), (line, loop)
        assert len(ratios) == 3 and (ratios[1] == "-") == (bf16 == "-" or vnni == "-")
