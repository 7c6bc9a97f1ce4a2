"""What this machine's CPU has, as Linux names it (``/proc/cpuinfo``'s flags), for the tests whose loops
need an instruction set the extension checks with cpuid (empty where the file is not there)."""

from __future__ import annotations

from pathlib import Path


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())
