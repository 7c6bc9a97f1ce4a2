"""Test-wide setup. Triton reads TRITON_INTERPRET when @triton.jit decorates, i.e. at import,
so it is set here before anything imports qscheme (GPU-less machines run kernels interpreted).

Marks for the fast inner loop (registered in pyproject.toml, see docs/testing.md):

- ``subprocess``: the test starts a process (the CLI, a fresh interpreter, a script);
- ``distributed``: it starts torch.distributed ranks (gloo process groups);
- ``oracle``: it runs a producer's own code in its side venv (``QSCHEME_*_PYTHON``);
- ``interpreter``: it runs Triton kernels in the interpreter for seconds.

Here ``distributed`` and ``oracle`` tests are also marked ``subprocess``, and all four ``slow``,
so that ``pytest -m "not slow"`` (``scripts/quick-test.sh``) is the quick loop. With
``QSCHEME_CHECK_MARKS=1`` (the quick script sets it) a test that starts a process without a
process mark fails; a passing test with such a mark that started none is listed at the end (it
may share a module fixture that started one for an earlier test).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Generator
from typing import Any

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

PROCESS_MARKS = ("subprocess", "distributed", "oracle")
SLOW_MARKS = (*PROCESS_MARKS, "interpreter")

# Audit events (sys.addaudithook) raised when a process is started.
SPAWN_EVENTS = frozenset(
    {"subprocess.Popen", "os.system", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.exec", "pty.spawn"}
)
CHECK_MARKS = os.environ.get("QSCHEME_CHECK_MARKS", "") not in ("", "0")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        marks = {mark.name for mark in item.iter_markers()}
        if marks & {"distributed", "oracle"} and "subprocess" not in marks:
            item.add_marker(pytest.mark.subprocess)
        if marks & set(SLOW_MARKS) and "slow" not in marks:
            item.add_marker(pytest.mark.slow)


class _SpawnWatch:
    """The processes started while the current test ran (setup and call), by audit event."""

    def __init__(self) -> None:
        self.active = False
        self.started: list[str] = []

    def __call__(self, event: str, args: tuple[Any, ...]) -> None:
        if self.active and event in SPAWN_EVENTS:
            shown = " ".join(str(part) for part in args[1] or ())[:160] if event == "subprocess.Popen" else ""
            self.started.append(f"{event} {shown}".rstrip())


_watch = _SpawnWatch()
_marked_but_quiet: list[str] = []
if CHECK_MARKS:
    sys.addaudithook(_watch)  # hooks cannot be removed: installed only when checking


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    _watch.started = []
    _watch.active = True
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    if not CHECK_MARKS or call.when != "call":
        return
    _watch.active = False
    report = outcome.get_result()
    marked = any(item.get_closest_marker(name) for name in PROCESS_MARKS)
    if _watch.started and not marked:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} started a process but has no process mark: mark it "
            f"@pytest.mark.subprocess (or distributed, oracle; see tests/conftest.py). Started:\n  "
            + "\n  ".join(_watch.started[:5])
        )
    elif marked and report.passed and not _watch.started:
        _marked_but_quiet.append(item.nodeid)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _marked_but_quiet:
        terminalreporter.section("marked as starting a process, started none (QSCHEME_CHECK_MARKS)")
        for nodeid in _marked_but_quiet:
            terminalreporter.line(nodeid)
