"""benchmarks/gpu_gemm.py runs end to end on the CPU (--smoke, Triton interpreter) with a row for
every kernel the resolver accepts there, and, without --smoke, stops with a clear message where
no CUDA GPU is visible."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qscheme.catalog import load_scheme
from qscheme.triton.samples import model_scale_dtype, random_weight

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"
SCRIPT = BENCHMARKS / "gpu_gemm.py"
HEADER = "| scheme | kernel | N x K | M | us | bf16 us | vs bf16 | vs triton | TFLOP/s | GB/s | bf16 GB/s |"


def _run(*arguments: str) -> subprocess.CompletedProcess[str]:
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *arguments], env=environment, capture_output=True, text=True, timeout=300
    )


def _table(text: str, header: str) -> list[list[str]]:
    rows = []
    for line in text[text.index(header) :].splitlines()[2:]:
        if not line.startswith("| "):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _accepted(scheme_name: str, n: int, k: int) -> tuple[str, ...]:
    """The kernels the resolver accepts for the layer on this CPU under the interpreter."""
    sys.path.insert(0, str(BENCHMARKS))
    kernel_table = importlib.import_module("kernel_table")
    scheme = load_scheme(scheme_name)
    weight = random_weight(scheme, n, k, seed=1, scale_dtype=model_scale_dtype(scheme, torch.bfloat16))
    kernels: tuple[str, ...] = kernel_table.runnable_kernels(weight, kernel_table.device_facts("cpu", True)).kernels
    return kernels


@pytest.mark.subprocess
def test_smoke_run_puts_every_accepted_kernel_side_by_side(tmp_path: Path) -> None:
    markdown = tmp_path / "table.md"
    completed = _run("--smoke", "--markdown", str(markdown))
    assert completed.returncode == 0, completed.stderr[-2000:]
    text = markdown.read_text()
    sys.path.insert(0, str(BENCHMARKS))
    gpu_gemm = importlib.import_module("gpu_gemm")
    expected = {
        (scheme, kernel, n, k, m)
        for scheme in gpu_gemm.SMOKE_SCHEMES
        for n, k in gpu_gemm.SMOKE_SHAPES
        for kernel in _accepted(scheme, n, k)
        for m in gpu_gemm.SMOKE_M_VALUES
    }
    assert {kernel for _, kernel, *_ in expected} >= {"triton", "reference"}
    rows = _table(text, HEADER)
    found = [(row[0], row[1], *map(int, row[2].split("x")), int(row[3])) for row in rows]
    assert len(found) == len(set(found)) and set(found) == expected
    assert {row[7] for row in rows if row[1] == "triton"} == {"1.00x"}  # vs triton: the same call's own time
    assert all(row[7].endswith("x") and row[6].endswith("x") for row in rows)
    errors = _table(text, "| scheme | kernel | N x K | error |")
    assert {(row[0], row[1], row[2]) for row in errors} == {(s, kernel, f"{n}x{k}") for s, kernel, n, k, _ in expected}
    assert all(float(row[3]) < 2.0**-6 for row in errors)
    memory = _table(text, "| scheme | kernel | N x K | canonical MiB | resident MiB (cpu) | x canonical |")
    n, k = gpu_gemm.SMOKE_SHAPES[0]
    assert {(row[0], row[1]) for row in memory} == {
        (s, kernel) for s, kernel, n_, k_, _ in expected if (n_, k_) == (n, k)
    }
    assert text.strip() in completed.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the script would benchmark it")
@pytest.mark.subprocess
def test_without_a_gpu_it_says_so() -> None:
    completed = _run()
    assert completed.returncode == 2
    assert "no CUDA GPU is visible" in completed.stderr and "--smoke" in completed.stderr


@pytest.mark.parametrize("name", ["compressed-tensors/W4A16", "compressed-tensors/W4A16_ASYM"])
def test_gemlite_operands_dequantize_to_the_canonical_weight(name: str) -> None:
    """GemLite's A16W4 computes (codes - zeros) * scales per group: the operands built for it
    give the canonical weight's float32 dequantization bit for bit (what GemLite then runs is
    timed on a GPU only)."""
    from qscheme.canonical import dequantize

    sys.path.insert(0, str(BENCHMARKS))
    gpu_gemm = importlib.import_module("gpu_gemm")
    weight = random_weight(load_scheme(name), 48, 384, seed=3, scale_dtype=torch.bfloat16)
    operands = gpu_gemm.gemlite_operands(weight)
    assert not isinstance(operands, str), operands
    codes, scales, zeros, group = operands
    assert codes.dtype == torch.uint8 and codes.shape == (48, 384) and int(codes.max()) <= 15 and group == 128
    rebuilt = (codes.float().reshape(48, 3, 128) - zeros[..., None].float()) * scales.float()[..., None]
    assert torch.equal(rebuilt.reshape(48, 384), dequantize(weight))


def test_gemlite_is_not_offered_what_it_cannot_run() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    gpu_gemm = importlib.import_module("gpu_gemm")
    reason = gpu_gemm.gemlite_operands(random_weight(load_scheme("compressed-tensors/NVFP4A16"), 32, 128))
    assert isinstance(reason, str) and "int4 / uint4 group-scaled weight-only" in reason
    assert "need a CUDA GPU" in gpu_gemm.gemlite_unavailable(smoke=True)
