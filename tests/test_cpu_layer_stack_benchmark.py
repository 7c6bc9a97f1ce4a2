"""benchmarks/cpu_layer_stack.py: the smoke run builds a stack per kernel the resolver accepts
(less the reference kernel and dequant_gemm unless named) beside bf16 F.linear, reports each
kernel's held bytes from its own state, and leaves torch's thread count as it found it. No
assertion is on a time."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
cpu_layer_stack = importlib.import_module("cpu_layer_stack")
kernel_table = importlib.import_module("kernel_table")


def table_rows(text: str) -> dict[str, list[str]]:
    rows = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [cell.strip() for cell in cells[1:]] for cells in rows[1:]}


@pytest.mark.parametrize("scheme", ["gguf/Q4_0", "compressed-tensors/NVFP4A16"])
def test_the_smoke_run_stacks_every_decode_kernel_beside_bf16(
    scheme: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    threads = torch.get_num_threads()
    out = tmp_path / "stack.md"
    assert cpu_layer_stack.main(["--smoke", "--threads", "1", "--scheme", scheme, "--markdown", str(out)]) == 0
    assert torch.get_num_threads() == threads
    rows = table_rows(capsys.readouterr().out)
    assert out.read_text(encoding="utf-8").count("\n| ") == len(rows) + 1  # the header's separator line too
    facts = kernel_table.device_facts("cpu", interpreter=False)
    weight = cpu_layer_stack.sample_weight(scheme, *cpu_layer_stack.SMOKE_SHAPES[0])
    expected = kernel_table.runnable_kernels(weight, facts, skip=cpu_layer_stack.SLOW).kernels
    assert expected and list(rows) == [cpu_layer_stack.DENSE, *expected]
    dense_mb = float(rows[cpu_layer_stack.DENSE][4])
    # 2 blocks of the smoke shapes in bf16
    assert dense_mb == pytest.approx(2 * sum(n * k * 2 for n, k in cpu_layer_stack.SMOKE_SHAPES) / 1e6, abs=0.05)
    for name in expected:
        cells = rows[name]
        assert float(cells[0]) > 0 and cells[1].endswith("x") and len(cells) == 5 + 4  # four distinct shapes
        assert float(cells[4]) > 0
    assert float(rows[expected[0]][4]) < dense_mb / 2  # the best-ranked 4-bit kernel holds the packed weight


def test_named_kernels_only_and_the_slow_ones_on_request(capsys: pytest.CaptureFixture[str]) -> None:
    arguments = ["--smoke", "--threads", "1", "--kernel", "cpu_gemv_blocks", "--kernel", "reference"]
    assert cpu_layer_stack.main(arguments) == 0
    assert list(table_rows(capsys.readouterr().out)) == [cpu_layer_stack.DENSE, "cpu_gemv_blocks", "reference"]


def test_a_scheme_no_kernel_runs_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert cpu_layer_stack.main(["--smoke", "--threads", "1", "--kernel", "no_such_kernel"]) == 1
    assert "no kernel runs gguf/Q4_0" in capsys.readouterr().err


def test_a_switch_adds_a_row_per_kernel_run_with_the_variable_off(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--switch VAR: each kernel's stack again, with VAR=0 while it runs (seen by the layers), and VAR
    as it was afterwards."""
    variable = "QSCHEME_TEST_STACK_SWITCH"
    monkeypatch.setenv(variable, "7")
    seen: list[str | None] = []
    real = cpu_layer_stack.build_layer

    def spying(*args: Any, **kwargs: Any) -> torch.nn.Module:
        layer = real(*args, **kwargs)
        layer.register_forward_pre_hook(lambda module, inputs: seen.append(os.environ.get(variable)))
        return layer

    monkeypatch.setattr(cpu_layer_stack, "build_layer", spying)
    args = ["--smoke", "--threads", "1", "--scheme", "gguf/Q4_0", "--kernel", "cpu_gemv_blocks", "--switch", variable]
    assert cpu_layer_stack.main(args) == 0
    rows = table_rows(capsys.readouterr().out)
    assert list(rows) == [cpu_layer_stack.DENSE, "cpu_gemv_blocks", f"cpu_gemv_blocks ({variable}=0)"]
    assert rows["cpu_gemv_blocks"][4] == rows[f"cpu_gemv_blocks ({variable}=0)"][4]  # the same layers' bytes
    assert set(seen) == {"7", "0"} and seen.count("0") == seen.count("7")
    assert os.environ[variable] == "7"
