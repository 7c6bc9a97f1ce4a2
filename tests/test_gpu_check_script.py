"""scripts/gpu-check.sh, the prepared run for a lent GPU: its steps fit one 10-minute command
and name scripts and tests that exist (a GPU session has no time to find a typo)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check.sh"


def _steps() -> list[tuple[str, int, str]]:
    text = SCRIPT.read_text(encoding="utf-8")
    return [(name, int(seconds), rest) for name, seconds, rest in re.findall(r"^step (\S+) (\d+) (.*)$", text, re.M)]


def test_step_limits_fit_a_ten_minute_command_with_room_to_start() -> None:
    steps = _steps()
    assert len(steps) >= 8
    assert len({name for name, _, _ in steps}) == len(steps)
    assert sum(seconds for _, seconds, _ in steps) <= 580


def test_steps_name_files_that_exist() -> None:
    paths = [path for _, _, rest in _steps() for path in re.findall(r"\b((?:benchmarks|tests)/\S+\.py)\b", rest)]
    assert "benchmarks/gpu_gemm.py" in paths and "benchmarks/host_overhead.py" in paths
    missing = [path for path in paths if not (ROOT / path).is_file()]
    assert not missing
