"""benchmarks/cpu_gemm.py and its helpers (benchmarks/kernel_table.py): the smoke run has a row
for every kernel the resolver accepts on the CPU, leaves out the interpreter-only ones, and
writes its tables; the resident-memory counter counts a layer's storages exactly once each.
No assertion is on a time."""

from __future__ import annotations

import dataclasses
import importlib
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from qscheme.catalog import load_scheme
from qscheme.modules import QuantLinear
from qscheme.triton.samples import model_scale_dtype, random_weight

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"
SCRIPT = BENCHMARKS / "cpu_gemm.py"
sys.path.insert(0, str(BENCHMARKS))
kernel_table = importlib.import_module("kernel_table")
cpu_gemm = importlib.import_module("cpu_gemm")

HEADER = (
    "| scheme | kernel | N x K | M | us | bf16 us | fp32 us | vs bf16 | vs fp32 | vs reference | GB/s | threads "
    "| vs dense GB/s |"
)
MEMORY_ROW = re.compile(
    r"^\| (\S+) \| (\S+) \| (\d+)x(\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \| ([\d.]+)x \|$", re.M
)


def _rows(text: str) -> list[list[str]]:
    """The cells of the timing table's rows (the first table of the text)."""
    lines = text[text.index(HEADER) :].splitlines()[2:]
    rows = []
    for line in lines:
        if not line.startswith("| "):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _weight(scheme_name: str, n: int, k: int) -> object:
    scheme = load_scheme(scheme_name)
    return random_weight(scheme, n, k, seed=1, scale_dtype=model_scale_dtype(scheme, torch.bfloat16))


def _tensor_bytes(tensors: object) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], str]:
    # TRITON_INTERPRET=1 stays set (conftest): the script must leave the interpreter-only kernels out anyway
    markdown = tmp_path_factory.mktemp("cpu_gemm") / "tables.md"
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--markdown", str(markdown)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed, markdown.read_text(encoding="utf-8")


@pytest.mark.subprocess
def test_smoke_has_a_row_for_every_kernel_the_resolver_accepts(
    smoke: tuple[subprocess.CompletedProcess[str], str],
) -> None:
    _, text = smoke
    (n, k) = cpu_gemm.SMOKE_SHAPES[0]
    facts = kernel_table.device_facts("cpu", interpreter=False)
    expected = set()
    for name in cpu_gemm.SCHEMES:
        kernels = kernel_table.runnable_kernels(_weight(name, n, k), facts).kernels
        assert "reference" in kernels  # the oracle runs every scheme on any device
        expected |= {(name, kernel, n, k, m) for kernel in kernels for m in cpu_gemm.SMOKE_M_VALUES}
    rows = _rows(text)
    found = [(row[0], row[1], *map(int, row[2].split("x")), int(row[3])) for row in rows]
    assert len(found) == len(set(found))
    assert set(found) == expected
    for row in rows:
        assert len(row) == 13 and all(float(cell) > 0 for cell in row[4:7])
        assert all(re.fullmatch(r"[\d.]+x", cell) for cell in row[7:10])
    # the reference kernel's ratio to itself: the column is the same rounds' reference time
    assert {row[9] for row in rows if row[1] == "reference"} == {"1.00x"}


@pytest.mark.subprocess
def test_interpreter_only_kernels_are_left_out(smoke: tuple[subprocess.CompletedProcess[str], str]) -> None:
    _, text = smoke
    n, k = cpu_gemm.SMOKE_SHAPES[0]
    weight = _weight("compressed-tensors/W4A16", n, k)
    with_interpreter = kernel_table.runnable_kernels(weight, kernel_table.device_facts("cpu", interpreter=True))
    without = kernel_table.runnable_kernels(weight, kernel_table.device_facts("cpu", interpreter=False))
    interpreter_only = set(with_interpreter.kernels) - set(without.kernels)
    assert interpreter_only  # the triton kernel runs on a CPU under the interpreter only
    tabled = {row[1] for row in _rows(text)}
    assert not interpreter_only & tabled


@pytest.mark.subprocess
def test_smoke_writes_the_error_and_memory_tables(smoke: tuple[subprocess.CompletedProcess[str], str]) -> None:
    completed, text = smoke
    assert HEADER in text
    assert "Largest error against the reference kernel at M=16" in text
    n, k = cpu_gemm.SMOKE_SHAPES[0]
    assert f"4-bit weight-only layers at {n}x{k}:\n- compressed-tensors/W4A16 " in text
    assert text.strip() in completed.stdout  # printed as written
    memory = {
        (s, kernel): (float(total), float(times)) for s, kernel, _, _, _, total, times, _ in MEMORY_ROW.findall(text)
    }
    rows = {(row[0], row[1]) for row in _rows(text)}
    assert set(memory) == rows
    # the reference kernel holds the canonical tensors only (no dequantized copy)
    assert memory[("compressed-tensors/W4A16", "reference")][1] == pytest.approx(1.0, abs=0.006)


@pytest.mark.parametrize("scheme_name", ["compressed-tensors/W4A16", "modelopt/W4A16_AWQ", "compressed-tensors/FP8"])
def test_resident_bytes_of_a_reference_layer(scheme_name: str) -> None:
    n, k = 48, 256
    weight = _weight(scheme_name, n, k)
    canonical = _tensor_bytes(weight.tensors().values())  # type: ignore[attr-defined]
    layer = QuantLinear(weight, "cpu", kernel="reference")
    assert kernel_table.canonical_bytes(layer) == canonical
    assert kernel_table.resident_bytes(layer) == {"cpu": canonical}  # nothing prepared yet
    with torch.inference_mode():
        layer(torch.randn(3, k, dtype=torch.bfloat16))
    # no dequantized copy: the state holds the canonical tensors themselves (AWQ's float32
    # pre-scale and the static input scales are the canonical buffers too, not second copies)
    assert kernel_table.resident_bytes(layer) == {"cpu": canonical}
    assert kernel_table.state_bytes(layer) == canonical
    row = kernel_table.memory_row(weight.scheme, "reference", layer)  # type: ignore[attr-defined]
    assert row.total == canonical and row.bf16_weight == n * k * 2


@dataclasses.dataclass(frozen=True)
class _State:
    weight: torch.Tensor
    parts: tuple[object, ...]
    extra: dict[str, object]


class _Slotted:
    __slots__ = ("hidden",)

    def __init__(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden


class _Plain:
    def __init__(self, value: object) -> None:
        self.value = value
        self.myself = self  # a cycle


def test_reachable_tensors_walks_containers_dataclasses_and_objects() -> None:
    base = torch.zeros(16, 8)  # 512 bytes
    other = torch.zeros(10, dtype=torch.int16)  # 20 bytes
    slotted = torch.zeros(3, dtype=torch.float64)  # 24 bytes
    plain = torch.zeros(5, dtype=torch.uint8)  # 5 bytes
    state = _State(
        weight=base,
        parts=(base[2:4], [other, {"nested": _Slotted(slotted)}]),
        extra={"again": base.t(), "object": _Plain(plain), "module": torch, "size": torch.Size([1])},
    )
    found = kernel_table.reachable_tensors(state)
    assert {id(t) for t in found} >= {id(base), id(other), id(slotted), id(plain)}
    assert kernel_table.storage_bytes(found) == {"cpu": 512 + 20 + 24 + 5}  # views count their storage once
    assert kernel_table.storage_bytes([base[:1]]) == {"cpu": 512}  # a view keeps its whole storage alive
    assert kernel_table.storage_bytes([torch.empty(0)]) == {}


def test_interleaved_medians_times_every_call_in_each_round() -> None:
    counts = {"a": 0, "b": 0}

    def call(name: str) -> None:
        counts[name] += 1

    times = kernel_table.interleaved_medians({"a": lambda: call("a"), "b": lambda: call("b")}, 3, 0.0, warmup=2)
    assert set(times) == {"a", "b"} and all(t >= 0 for t in times.values())
    assert counts == {"a": 2 + 1 + 3, "b": 2 + 1 + 3}  # warm-up, the calibrating call, one per round


def test_interleaved_medians_gives_slow_calls_fewer_rounds() -> None:
    counts = {"fast": 0, "slow": 0}

    def fast() -> None:
        counts["fast"] += 1

    def slow() -> None:
        counts["slow"] += 1
        time.sleep(0.01)

    kernel_table.interleaved_medians({"fast": fast, "slow": slow}, 6, 0.0, warmup=1, budget_seconds=0.035)
    assert counts == {"fast": 1 + 1 + 6, "slow": 1 + 1 + 3}  # 0.035 s affords the slow call 3 rounds, its least


def test_parse_shape() -> None:
    assert kernel_table.parse_shape("4096x14336") == (4096, 14336)
    for bad in ("4096", "0x16", "ax4"):
        with pytest.raises(ValueError, match="NxK"):
            kernel_table.parse_shape(bad)
