"""A one-line progress bar on stderr, shown only on a terminal (and only for large jobs).

The bar redraws itself with ``\\r``, which the command's stderr (``TerminalOutput``) would escape:
it is written with the stream's ``write_control`` where it has one, and the item it names (a
tensor or layer from the checkpoint) is escaped and cut first.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from qscheme.text import shown

LARGE_CHECKPOINT_BYTES = 256 * 1024 * 1024


class Progress:
    """``with Progress(total, "loading") as bar: bar.advance()``; silent when disabled."""

    def __init__(self, total: int, label: str, enabled: bool | None = None, stream: TextIO | None = None) -> None:
        self.total = max(total, 1)
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.done = 0
        self._last = 0.0

    def __enter__(self) -> Progress:
        self._draw(force=True)
        return self

    def advance(self, count: int = 1, item: str = "") -> None:
        self.done += count
        self._draw(item=item)

    def _draw(self, item: str = "", force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.1 and self.done < self.total:
            return
        self._last = now
        width = 30
        filled = int(width * self.done / self.total)
        name = shown(item)
        name = name if len(name) <= 40 else "..." + name[-37:]
        self._write(f"\r{self.label} [{'#' * filled}{' ' * (width - filled)}] {self.done}/{self.total} {name:<40}")

    def _write(self, text: str) -> None:
        write_control = getattr(self.stream, "write_control", None)
        if write_control is not None:
            write_control(text)
        else:
            self.stream.write(text)
            self.stream.flush()

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._write("\r" + " " * 100 + "\r")


def auto_enabled(total_bytes: int, requested: bool | None) -> bool:
    """Show progress when asked, or by default for large checkpoints on a terminal; UsageError
    for a ``progress`` that is not True, False or None."""
    from qscheme.api_checks import require_optional_flag

    asked = require_optional_flag(requested, "progress", "the progress bar")
    if asked is not None:
        return asked
    return total_bytes >= LARGE_CHECKPOINT_BYTES and sys.stderr.isatty()
