"""benchmarks/quantize_speed.py's plumbing at a tiny size: the smoke run measures every step and
writes its table and verdicts; the source is as large as asked and cut between layers; the memory
bound comes from the headers; each child's peak RSS is its own. No assertion is on a time."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"
SCRIPT = BENCHMARKS / "quantize_speed.py"
sys.path.insert(0, str(BENCHMARKS))
quantize_speed = importlib.import_module("quantize_speed")
ROW = re.compile(
    r"^\| (quantize|convert) \| ([^|]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| (\d+) \| (\d+) \|$", re.M
)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    markdown = tmp_path_factory.mktemp("quantize_speed") / "table.md"
    env = {key: value for key, value in os.environ.items() if key != quantize_speed.LLMCOMPRESSOR_ENV}
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--gb", "0.004", "--hidden", "128", "--shards", "3", "--markdown", str(markdown)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed.stdout, markdown.read_text(encoding="utf-8")


@pytest.mark.subprocess
def test_smoke_measures_every_step_and_writes_the_table(smoke: tuple[str, str]) -> None:
    stdout, text = smoke
    assert text == stdout  # printed as written
    rows = {tool.strip(): values for step, tool, *values in ROW.findall(text)}
    # model_free_ptq is left out without its venv, and the table says so
    assert set(rows) == {"qscheme quantize", "copy (shutil.copyfile)", "copy + fsync", "qscheme convert"}
    assert f"model_free_ptq not measured: {quantize_speed.LLMCOMPRESSOR_ENV} is not set" in text
    for values in rows.values():
        megabytes, call, wall, throughput, peak, bound = map(float, values)
        assert megabytes > 0 and call > 0 and wall >= call and throughput > 0 and 0 < peak and bound > 300
    # the convert's input is the quantized output, smaller than the bf16 source (embeddings stay bf16)
    assert float(rows["qscheme convert"][0]) < 0.6 * float(rows["qscheme quantize"][0])
    assert rows["qscheme convert"][0] == rows["copy (shutil.copyfile)"][0]
    # a child's peak RSS is its own: the copy imports no torch
    assert float(rows["copy (shutil.copyfile)"][4]) < 100 < float(rows["qscheme quantize"][4])
    lines = [line for line in text.splitlines() if line.startswith("- ") and "not measured" not in line]
    verdicts = [line for line in lines if "for reference" not in line]
    assert len(verdicts) == 3 and all(line.endswith((": met", ": MISSED")) for line in verdicts)
    assert any("a copy that also fsyncs" in line for line in lines)


@pytest.mark.subprocess
def test_source_size_layout_and_memory_bound(tmp_path: Path) -> None:
    shape = quantize_speed.llama_shape(0.003, 128)
    quantize_speed.generate(tmp_path, shape, 3)
    assert quantize_speed.safetensors_bytes(tmp_path) >= 0.003e9  # as large as asked
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    for layer in range(shape.layers):  # cut between layers: each layer's tensors lie in one shard
        assert len({shard for name, shard in index["weight_map"].items() if f".layers.{layer}." in name}) == 1
    # the bound: largest shard + 3 x largest tensor (bf16: the embedding or lm_head) + 300 MB
    largest_shard = max(path.stat().st_size for path in tmp_path.glob("*.safetensors"))
    largest_tensor = max(2 * quantize_speed._numel(dims) for _, dims in shape.tensor_shapes())
    assert quantize_speed.memory_bound(tmp_path) == largest_shard + 3 * largest_tensor + 300_000_000


@pytest.mark.subprocess
def test_measure_reports_the_childs_own_peak_rss() -> None:
    # measured from a lean process, as the script does: a child's ru_maxrss starts at the RSS of
    # the process it was forked from, and this test process holds torch
    big = "b = bytearray(200_000_000); b[::4096] = b'x' * len(b[::4096]); print('{\"seconds\": 1.5}')"
    small = "print('{\"seconds\": [0.25]}')"
    code = (
        f"import json, sys; sys.path.insert(0, {str(BENCHMARKS)!r}); import quantize_speed as q; "
        f"print(json.dumps([q.measure([sys.executable, '-c', {big!r}], 'whole')[:3], "
        f"q.measure([sys.executable, '-c', {small!r}], 'last-line')[:3]]))"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0, completed.stderr
    (seconds, wall, peak), (small_seconds, _, small_peak) = json.loads(completed.stdout)
    assert seconds == 1.5 and wall > 0 and peak >= 200_000_000
    assert small_seconds == 0.25 and small_peak < 100_000_000
    with pytest.raises(RuntimeError, match="exited 3"):
        quantize_speed.measure([sys.executable, "-c", "raise SystemExit(3)"], "whole")


def test_verdicts_compare_with_the_targets() -> None:
    def run(step: str, tool: str, seconds: float, peak: int, bound: int = 10**9) -> object:
        return quantize_speed.Run(step, tool, 10**9, seconds, seconds + 1, peak, bound)

    runs = [
        run("quantize", "llm-compressor model_free_ptq", 10.0, 900),
        run("quantize", "qscheme quantize", 4.0, 1000),  # 2.5x as fast, more memory
        run("convert", "copy (shutil.copyfile)", 1.0, 20),
        run("convert", "qscheme convert", 3.0, 2 * 10**9),  # a third as fast, over its bound
    ]
    assert quantize_speed.verdicts(runs) == [
        "quantize throughput: 2.50x model_free_ptq's (target >= 2x): met",
        "quantize peak RSS: 1.11x model_free_ptq's (target <= 1x): MISSED",
        "convert throughput: 0.33x the copy's (target >= 0.5x): MISSED",
        "qscheme quantize peak RSS 0 MB vs bound 1000 MB: met",
        "qscheme convert peak RSS 2000 MB vs bound 1000 MB: MISSED",
    ]
