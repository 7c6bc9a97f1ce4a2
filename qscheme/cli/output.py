"""Where a command's output goes: guarded streams, terminal-safe text, JSON, plain-text tables.

Text output (every command without ``--json``) is written through ``TerminalOutput``, which
escapes control characters and bounds line length (the reasons and the rule are in its
docstring and in ``qscheme.text``); error messages are also bounded in lines, with
repeated lines counted (``bounded_message``).

JSON is strict (RFC 8259): a float that is NaN or infinite (an error that overflowed, a
kernel that returned NaN) is written as ``null``; ``json.dumps`` escapes control characters.
Under ``--json`` the command runs with ``sys.stdout`` sent to stderr, and where stdout is the
process's own, file descriptor 1 as well, so that whatever plugins or kernels print (with
``print`` or from native code) cannot corrupt the JSON document; ``print_json`` writes to the
real stdout.

A stdout that cannot be written (a full disk, a descriptor closed with ``>&-``) is an
OutputError: one line on stderr, exit 1. A pipe closed by its reader (``| head -1``) exits 1
without a message. A stderr that cannot be written is ignored: the exit code is the command's.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

from qscheme.errors import OutputError
from qscheme.text import cut, escape, problem_kind

LINE_LIMIT = 2000  # characters of one line of text output; a longer one keeps its start and end
MESSAGE_LINES = 200  # lines of one error message
REPEATS_SHOWN = 3  # consecutive lines of one kind shown before "... and N more like this"

_json_stream: GuardedOutput | TextIO | None = None  # the real stdout while a --json command runs


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float (in dicts, lists and tuples) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite(item) for item in value]
    return value


def print_json(value: Any) -> None:
    """Write ``value`` as indented JSON; non-finite floats become null (never NaN/Infinity)."""
    text = json.dumps(finite(value), indent=2, sort_keys=False, default=str, allow_nan=False)
    (_json_stream or sys.stdout).write(text + "\n")


class _DivertedDescriptor:
    """File descriptor 1 pointed at stderr (or /dev/null) for a while; ``file`` writes to the old stdout."""

    def __init__(self, descriptor: int, kept: int, file: TextIO) -> None:
        self.descriptor = descriptor
        self.kept = kept
        self.file = file

    def restore(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.file.flush()
        os.dup2(self.kept, self.descriptor)
        with contextlib.suppress(OSError, ValueError):
            self.file.close()  # closes ``kept``


def _divert_descriptor(current: object) -> _DivertedDescriptor | None:
    """Divert descriptor 1 when ``current`` writes to the process's own stdout (not in tests that
    capture it in memory, where only ``sys.stdout`` is redirected)."""
    real = sys.__stdout__
    if real is None or getattr(current, "stream", current) is not real:
        return None
    try:
        real.flush()
        descriptor = real.fileno()
        kept = os.dup(descriptor)
    except (OSError, ValueError):
        return None
    try:
        os.dup2(2, descriptor)
    except OSError:  # stderr is closed: stray output is dropped
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, descriptor)
        os.close(devnull)
    file = open(kept, "w", encoding=real.encoding or "utf-8", errors="backslashreplace", closefd=True)
    return _DivertedDescriptor(descriptor, kept, file)


@contextlib.contextmanager
def json_output() -> Iterator[None]:
    """Run a --json command: stray prints go to stderr, ``print_json`` to the current stdout."""
    global _json_stream
    saved = _json_stream
    current = sys.stdout
    diverted = _divert_descriptor(current)
    stream = GuardedOutput(diverted.file) if diverted is not None else current
    _json_stream = stream
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
        stream.flush()
    finally:
        _json_stream = saved
        if diverted is not None:
            diverted.restore()


def bounded_message(text: str, max_lines: int = MESSAGE_LINES, line_limit: int = LINE_LIMIT) -> str:
    """An error message fit for a terminal: every line at most ``line_limit`` characters, a run of
    more than a few consecutive lines of the same kind (``problem_kind``, at the same indentation)
    shown as its first lines and ``... and 4,997 more like this``, at most ``max_lines`` lines."""
    lines = [cut(line, line_limit) for line in text.split("\n")]
    collapsed: list[str] = []
    start = 0
    while start < len(lines):
        end = start + 1
        key = _line_kind(lines[start])
        while end < len(lines) and _line_kind(lines[end]) == key:
            end += 1
        run = lines[start:end]
        if len(run) > REPEATS_SHOWN + 1:
            stripped = run[0].lstrip()
            indent = run[0][: len(run[0]) - len(stripped)] + ("  " if stripped.startswith("- ") else "")
            collapsed.extend(run[:REPEATS_SHOWN])
            collapsed.append(f"{indent}... and {len(run) - REPEATS_SHOWN:,} more like this")
        else:
            collapsed.extend(run)
        start = end
    if len(collapsed) > max_lines:
        cut_lines = len(collapsed) - (max_lines - 1)
        collapsed = [*collapsed[: max_lines - 1], f"... [{cut_lines:,} more lines cut]"]
    return "\n".join(collapsed)


def _line_kind(line: str) -> tuple[str, str]:
    stripped = line.lstrip()
    return line[: len(line) - len(stripped)], problem_kind(stripped) if stripped else ""


class GuardedOutput:
    """A command's stdout: a write error is an OutputError (exit 1); a broken pipe passes through
    as BrokenPipeError (``main`` exits 1 without a message: the reader chose to stop reading).

    ``stream`` is None when the process started with that descriptor closed (``>&-``); writing
    is then an OutputError too, unless ``required`` is false (stderr: nowhere to report that).
    """

    def __init__(self, stream: TextIO | None, name: str = "stdout", required: bool = True) -> None:
        self.stream = stream
        self.name = name
        self.required = required

    def _closed(self) -> None:
        if self.required:
            raise OutputError(f"cannot write output: {self.name} is closed")

    def _write(self, text: str) -> None:
        if self.stream is None:
            self._closed()
            return
        try:
            self.stream.write(text)
        except BrokenPipeError:
            if self.required:
                raise
        except (OSError, ValueError) as exc:  # ValueError: the stream object was closed
            if self.required:
                raise OutputError(f"cannot write output: {_reason(exc)}") from None

    def write(self, text: str) -> int:
        self._write(text)
        return len(text)

    def flush(self) -> None:
        if self.stream is None:
            return
        try:
            self.stream.flush()
        except BrokenPipeError:
            if self.required:
                raise
        except (OSError, ValueError) as exc:
            if self.required:
                raise OutputError(f"cannot write output: {_reason(exc)}") from None

    def isatty(self) -> bool:
        try:
            return self.stream is not None and self.stream.isatty()
        except (OSError, ValueError):
            return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _reason(exc: Exception) -> str:
    return (exc.strerror if isinstance(exc, OSError) else None) or str(exc)


class TerminalOutput(GuardedOutput):
    """A stream for text meant for a person: the one chokepoint every text line passes through.

    Every character that is not printable is escaped (``qscheme.text.escape``) except
    the newline, because the text written here is whole messages and tables whose lines qscheme
    joined itself; a newline inside an untrusted name is escaped where the name is formatted
    (``shown``, ``listing``), which is the only place that can tell the two apart. Every line is
    bounded to ``line_limit`` characters (its start and end kept, the cut counted), so one
    megabyte-long tensor name cannot flood a terminal. Text is passed on a line at a time; a
    partial line waits for its newline or for ``flush``. ``write_control`` writes terminal control
    text (a progress bar's ``\\r``) unescaped.
    """

    def __init__(
        self, stream: TextIO | None, name: str = "stdout", required: bool = True, line_limit: int = LINE_LIMIT
    ) -> None:
        super().__init__(stream, name, required)
        self.line_limit = line_limit
        self._pending = ""

    def _line(self, line: str) -> str:
        return cut(escape(line), self.line_limit)  # escaped first: the bound holds for what is written

    def write(self, text: str) -> int:
        if "\n" not in text:
            self._pending += text
            return len(text)
        first, *middle, last = (self._pending + text).split("\n")
        self._pending = last
        self._write("\n".join(self._line(line) for line in (first, *middle)) + "\n")
        return len(text)

    def flush(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, ""
            self._write(self._line(pending))
        super().flush()

    def write_control(self, text: str) -> None:
        """Write ``text`` as it is (trusted terminal control, such as a progress bar's redraw)."""
        self.flush()
        self._write(text)
        super().flush()


def table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    """Left-aligned columns separated by two spaces."""
    all_rows = [list(header), *[list(r) for r in rows]]
    widths = [max(len(str(r[i])) for r in all_rows) for i in range(len(header))]
    lines = ["  ".join(str(cell).ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in all_rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
