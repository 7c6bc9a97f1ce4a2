"""``OutputFolder``: a checkpoint is written beside DST and renamed into place only when complete.

The guarantees, in order:

- before anything is written, a DST that exists (without ``force``), or that is, lies inside or
  contains a source, is refused with a DestinationError;
- the files go into a hidden temporary folder in DST's parent (``.<name>.qscheme-partial-<pid>``),
  so the final rename stays on one file system and is atomic;
- ``commit()`` renames it to DST. With ``force`` an existing DST is first renamed aside
  (``.<name>.qscheme-old-<pid>``) and deleted only once the new folder is in place; if the
  rename fails, the old DST is put back;
- leaving the ``with`` block without ``commit()`` (an exception, Ctrl-C, or SIGTERM / SIGHUP
  turned into ``Terminated`` by ``raise_on_termination``) deletes the temporary folder.

A run killed outright (SIGKILL, power loss) cannot clean up: it leaves no DST, only the hidden
partial folder, which the next run for the same DST deletes (when the process that made it is
gone).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType, TracebackType

from qscheme.errors import DestinationError

PARTIAL_MARK = ".qscheme-partial-"
OLD_MARK = ".qscheme-old-"


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived while a checkpoint was being written (raised to run the cleanup)."""

    def __init__(self, signal_number: int) -> None:
        super().__init__(f"terminated by signal {signal.Signals(signal_number).name}")
        self.signal_number = signal_number


@contextlib.contextmanager
def raise_on_termination() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise ``Terminated`` (so ``finally`` and ``__exit__`` run).

    Only in the main thread (signal handlers cannot be set elsewhere); the previous handlers are
    restored on exit.
    """
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(number: int, frame: FrameType | None) -> None:
        raise Terminated(number)

    previous = {}
    for number in (signal.SIGTERM, signal.SIGHUP):
        previous[number] = signal.signal(number, handler)
    try:
        yield
    finally:
        for number, old in previous.items():
            signal.signal(number, old)


def _resolved(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class OutputFolder:
    """``with OutputFolder(dst, force=..., sources=[src]) as out: ...write into out.path...; out.commit()``."""

    def __init__(self, dst: str | Path, *, force: bool, sources: Sequence[str | Path]) -> None:
        self.dst = Path(dst)
        self.force = force
        if not self.dst.name or self.dst.name in (".", ".."):
            raise DestinationError(f"{self.dst}: give the output folder a name (e.g. ./model-nvfp4)")
        resolved = _resolved(self.dst)
        for source in sources:
            src = _resolved(Path(source))
            if _within(resolved, src):
                where = "the source" if resolved == src else "inside the source"
                raise DestinationError(
                    f"{self.dst}: the output folder would be {where} {source}; the source is never modified: "
                    "choose an output folder outside it"
                )
            if _within(src, resolved):
                raise DestinationError(
                    f"{self.dst}: the output folder contains the source {source}; writing it would replace the "
                    "source: choose another output folder"
                )
        if os.path.lexists(self.dst) and not force:
            kind = "folder" if self.dst.is_dir() else "file"
            raise DestinationError(
                f"{self.dst}: already exists (a {kind}); nothing was written. Pass --force (force=True) to "
                "replace it, or choose another output folder"
            )
        self.parent = self.dst.parent if str(self.dst.parent) else Path(".")
        self.path = self.parent / f".{self.dst.name}{PARTIAL_MARK}{os.getpid()}"
        self.committed = False

    def __enter__(self) -> OutputFolder:
        try:
            self.parent.mkdir(parents=True, exist_ok=True)
            self.remove_stale()
            self.path.mkdir()
        except OSError as exc:
            raise DestinationError(f"{self.path}: cannot create the temporary output folder: {exc.strerror}") from None
        return self

    def remove_stale(self) -> list[Path]:
        """Delete partial folders for this DST left by runs that were killed (their process is gone)."""
        removed = []
        prefix = f".{self.dst.name}"
        for mark in (PARTIAL_MARK, OLD_MARK):
            for candidate in self.parent.glob(f"{prefix}{mark}*"):
                pid_text = candidate.name[len(prefix) + len(mark) :]
                if not pid_text.isdigit():
                    continue
                pid = int(pid_text)
                if pid == os.getpid() or not _process_alive(pid):
                    shutil.rmtree(candidate, ignore_errors=True)
                    removed.append(candidate)
        return removed

    def commit(self) -> None:
        """Rename the finished folder to DST (replacing an existing DST only with ``force``)."""
        old: Path | None = None
        try:
            if os.path.lexists(self.dst):
                if not self.force:  # appeared while we were writing
                    raise DestinationError(
                        f"{self.dst}: appeared while the checkpoint was written; nothing was replaced. Pass --force "
                        "to replace it"
                    )
                old = self.parent / f".{self.dst.name}{OLD_MARK}{os.getpid()}"
                os.replace(self.dst, old)
            try:
                os.replace(self.path, self.dst)
            except OSError:
                if old is not None:
                    os.replace(old, self.dst)
                raise
        except OSError as exc:
            raise DestinationError(
                f"{self.dst}: cannot move the finished checkpoint into place: {exc.strerror}"
            ) from None
        self.committed = True
        if old is not None:
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    old.unlink()

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if not self.committed:
            shutil.rmtree(self.path, ignore_errors=True)
