"""scripts/gpu-check.sh, the prepared run for a lent GPU: its steps fit under 9 minutes (one
10-minute command with room to start), name scripts and tests that exist (a GPU session has no
time to find a typo), and run issue 16's checks first: the Triton GPU tests, then one
side-by-side table of every kernel at the issue's shapes and M."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check.sh"


def _steps() -> list[tuple[str, int, str]]:
    text = SCRIPT.read_text(encoding="utf-8")
    return [(name, int(seconds), rest) for name, seconds, rest in re.findall(r"^step (\S+) (\d+) (.*)$", text, re.M)]


def test_step_limits_fit_nine_minutes() -> None:
    steps = _steps()
    assert len(steps) >= 6
    assert len({name for name, _, _ in steps}) == len(steps)
    assert sum(seconds for _, seconds, _ in steps) <= 530  # plus nvidia-smi and a version line


def test_the_triton_gpu_tests_then_one_side_by_side_run_come_first() -> None:
    steps = [(name, rest) for name, _, rest in _steps() if not name.endswith("install")]
    assert "tests/test_triton_gpu.py" in steps[0][1]
    benchmark = steps[1][1]
    assert "benchmarks/gpu_gemm.py" in benchmark
    assert [rest for _, rest in steps].count(benchmark) == 1
    for argument in (
        "--scheme compressed-tensors/NVFP4A16",
        "--scheme compressed-tensors/W4A16",
        "--shape 8192x8192",
        "--shape 16384x16384",
        "--m 1 --m 4 --m 16",
    ):
        assert argument in benchmark
    assert "--no-gemlite" not in benchmark
    assert sum("benchmarks/gpu_gemm.py" in rest for _, rest in steps) == 1  # ONE run of the table


def test_gemlite_is_installed_offline_from_the_wheel_folder() -> None:
    text = SCRIPT.read_text(encoding="utf-8")
    assert "build/wheels/gemlite-*.whl" in text and "--no-index" in text and "--no-deps" in text
    assert (ROOT / "scripts" / "build-gemlite-wheel.sh").is_file()


def test_steps_name_files_that_exist() -> None:
    paths = [path for _, _, rest in _steps() for path in re.findall(r"\b((?:benchmarks|tests)/\S+\.py)\b", rest)]
    assert "benchmarks/gpu_gemm.py" in paths and "benchmarks/host_overhead.py" in paths
    missing = [path for path in paths if not (ROOT / path).is_file()]
    assert not missing
