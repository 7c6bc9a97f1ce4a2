"""Small helpers shared by commands: JSON output, plain-text tables, and a guarded stdout.

JSON is strict (RFC 8259): a float that is NaN or infinite (an error that overflowed, a
kernel that returned NaN) is written as ``null``. Under ``--json`` the command runs with
``sys.stdout`` sent to stderr, so that whatever plugins or kernels print cannot corrupt the
JSON document; ``print_json`` writes to the real stdout.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

from qscheme.errors import OutputError

_json_stream: TextIO | None = None  # the real stdout while a --json command runs


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


@contextlib.contextmanager
def json_output() -> Iterator[None]:
    """Run a --json command: stray prints go to stderr, ``print_json`` to the current stdout."""
    global _json_stream
    saved = _json_stream
    _json_stream = sys.stdout
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _json_stream = saved


class GuardedOutput:
    """A text stream whose write errors are an OutputError (BrokenPipeError passes through)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputError(f"cannot write output: {exc.strerror or exc}") from None

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputError(f"cannot write output: {exc.strerror or exc}") from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    """Left-aligned columns separated by two spaces."""
    all_rows = [list(header), *[list(r) for r in rows]]
    widths = [max(len(str(r[i])) for r in all_rows) for i in range(len(header))]
    lines = ["  ".join(str(cell).ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in all_rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
