"""``OutputFolder``: a checkpoint is written beside DST and renamed into place only when complete.

The guarantees, in order:

- before anything is written, a DST that exists (without ``force``), or that is, lies inside or
  contains a source, is refused with a DestinationError; with ``force``, so is a DST that holds
  something the source still needs: a file or folder a link of the source resolves into (the
  Hugging Face cache layout: a snapshot's files are links to ``../../blobs``);
- the files go into a hidden temporary folder in DST's parent,
  ``.<name>.qscheme-partial-<pid>-<random token>``, created exclusively by this run (so the final
  rename stays on one file system and is atomic). It holds an owner record (``run_owner``) until
  the commit. Besides its own folder, a run deletes only partial folders for the same DST whose
  name parses exactly and whose owner record shows a run of this machine and process-id
  namespace that is gone (SIGKILL, power loss): never a live run's, another container's or
  machine's, or a folder without a record;
- ``commit()`` renames it to DST. With ``force`` an existing DST is first renamed aside to
  ``.<name>.qscheme-old-<pid>-<token>``, the new folder renamed in, and the old one deleted
  only then. SIGINT, SIGTERM and SIGHUP are held back (``signals_held``) during the two
  renames (their handlers run after the commit), so a signal cannot land between them; any
  failure there puts the old DST back, and the error says what is on disk;
- leaving the ``with`` block without ``commit()`` (an exception, Ctrl-C, or SIGTERM / SIGHUP
  turned into ``Terminated`` by ``raise_on_termination``) deletes the temporary folder. A signal
  that arrives once the commit is done is raised as well, and ``Terminated.committed`` then names
  DST, which is complete.

A run killed outright (SIGKILL, power loss) cannot clean up: it leaves its hidden partial folder,
which the next run for the same DST on the same machine deletes (see above); a folder from
another machine sharing the file system is left for the user to delete. Killed between the two
renames of a forced commit, it leaves the old DST complete under its ``-old-`` name, which is
never deleted automatically: rename it back.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType, TracebackType

from qscheme.errors import DestinationError
from qscheme.storage.run_owner import remove_dead_runs, remove_owner, this_run, write_owner

PARTIAL_MARK = ".qscheme-partial-"
OLD_MARK = ".qscheme-old-"
# Entries of the source walked to find links into DST before a forced replace: far more than a
# checkpoint folder holds; a source with more is refused rather than half checked.
MAX_SOURCE_ENTRIES = 100_000
_HELD_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived while a checkpoint was being written (raised to run the cleanup).

    ``committed`` is DST when the signal arrived after the finished checkpoint was moved into
    place (it is complete), None when nothing was moved into place."""

    def __init__(self, signal_number: int) -> None:
        super().__init__(f"terminated by signal {signal.Signals(signal_number).name}")
        self.signal_number = signal_number
        self.committed: Path | None = None


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


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP arriving inside the block are held and handled after it: their
    previous handler then runs (``Terminated`` or KeyboardInterrupt is raised after the block; a
    default action ends the process then). Python runs signal handlers in the main thread only,
    so elsewhere nothing can interrupt the block and nothing is changed. (A thread signal mask
    would not do: the kernel hands a process's signal to any thread that does not block it, and
    Python's handler then runs in the main thread all the same.)"""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def hold(number: int, frame: FrameType | None) -> None:
        pending.append(number)

    previous = {int(number): signal.signal(number, hold) for number in _HELD_SIGNALS}
    try:
        yield
    finally:
        for number, old in previous.items():
            signal.signal(number, old)
        if pending:
            first = pending[0]
            handler = previous[first]
            if callable(handler):
                handler(first, None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(first)


def _delete(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def _resolved(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def links_into(source: Path, folder: Path) -> Path | None:
    """The first entry of ``source`` (the folder itself, or any link in it, walked without
    following links to folders) that resolves into ``folder``; None when there is none.
    DestinationError when the source has more than ``MAX_SOURCE_ENTRIES`` entries."""
    if _within(_resolved(source), folder):
        return source
    if source.is_symlink() or not source.is_dir():
        return None
    seen = 0
    pending = [source]
    while pending:
        current = pending.pop()
        try:
            entries = list(os.scandir(current))
        except OSError:
            continue  # unreadable: the writer refuses it when it reads it
        for entry in entries:
            seen += 1
            if seen > MAX_SOURCE_ENTRIES:
                raise DestinationError(
                    f"{source}: holds more than {MAX_SOURCE_ENTRIES} entries; --force cannot check that none of "
                    "them links into the output folder: choose an output folder that does not exist"
                )
            path = Path(entry.path)
            if entry.is_symlink():
                if _within(_resolved(path), folder):
                    return path
            elif entry.is_dir(follow_symlinks=False):
                pending.append(path)
    return None


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
        if os.path.lexists(self.dst):
            self._refuse_needed_by_source(sources, resolved)
        self.parent = self.dst.parent if str(self.dst.parent) else Path(".")
        self.token = f"{os.getpid()}-{secrets.token_hex(6)}"
        self.path = self.parent / f".{self.dst.name}{PARTIAL_MARK}{self.token}"
        self.created = False
        self.committed = False

    def _refuse_needed_by_source(self, sources: Sequence[str | Path], resolved: Path) -> None:
        for source in sources:
            link = links_into(Path(source), resolved)
            if link is not None:
                raise DestinationError(
                    f"{self.dst}: --force would delete what the source still needs: {link} resolves to "
                    f"{_resolved(link)}, inside the output folder (the Hugging Face cache links a snapshot's files "
                    "this way); nothing was written. Choose another output folder"
                )

    def __enter__(self) -> OutputFolder:
        try:
            self.parent.mkdir(parents=True, exist_ok=True)
            self.path.mkdir()  # exclusive: fails if the name exists, so the folder is this run's own
            self.created = True
            me = this_run(self.token)
            write_owner(self.path, me)
            remove_dead_runs(self.parent, f".{self.dst.name}{PARTIAL_MARK}", me)
        except OSError as exc:
            raise DestinationError(f"{self.path}: cannot create the temporary output folder: {exc.strerror}") from None
        return self

    def commit(self) -> None:
        """Rename the finished folder to DST (replacing an existing DST only with ``force``)."""
        old: Path | None = None
        try:
            with signals_held():  # a signal held here is raised when the block ends: after the commit
                remove_owner(self.path)
                if os.path.lexists(self.dst):
                    if not self.force:  # appeared while we were writing
                        raise DestinationError(
                            f"{self.dst}: appeared while the checkpoint was written; nothing was replaced. Pass "
                            "--force to replace it"
                        )
                    old = self.parent / f".{self.dst.name}{OLD_MARK}{self.token}"
                    try:
                        os.replace(self.dst, old)
                    except OSError as exc:
                        raise DestinationError(
                            f"{self.dst}: cannot move the existing output aside to replace it: {exc.strerror}; it "
                            "is unchanged and nothing was written"
                        ) from None
                try:
                    os.replace(self.path, self.dst)
                except OSError as exc:
                    raise DestinationError(self._failed_commit(old, exc)) from None
                self.committed = True
        finally:
            if self.committed and old is not None:
                _delete(old)

    def _failed_commit(self, old: Path | None, exc: OSError) -> str:
        """Put the old DST back after the new folder could not be renamed in; what is on disk."""
        said = f"{self.dst}: cannot move the finished checkpoint into place: {exc.strerror}"
        if old is None:
            return f"{said}; nothing was written"
        try:
            os.replace(old, self.dst)
        except OSError as again:
            return (
                f"{said}, and the previous output could not be put back ({again.strerror}): it is kept, complete, "
                f"at {old}; rename it to {self.dst}. The new checkpoint was deleted"
            )
        return f"{said}; the previous output is back in place, unchanged, and nothing was written"

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self.committed:
            if isinstance(value, Terminated):
                value.committed = self.dst
            return
        if self.created:
            shutil.rmtree(self.path, ignore_errors=True)
