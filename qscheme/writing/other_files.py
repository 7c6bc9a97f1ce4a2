"""The source's other files (tokenizer, generation config, chat template...), copied through safely.

Everything is checked before anything is written (``plan_other_files``), then copied
(``copy_other_files``). An entry is copied only when it is:

- a regular file, or a folder whose entries are (walked without following links, at most
  ``MAX_DEPTH`` levels and ``MAX_ENTRIES`` entries in all, so a folder loop cannot be entered);
- or a link that resolves to a regular file inside the source folder. A Hugging Face cache
  snapshot (``.../snapshots/<revision>``) links its files to ``../../blobs/<hash>``: a link into
  that repository's ``blobs`` folder counts as inside the source;
- at most ``MAX_FILE_BYTES`` bytes (4 GiB; the environment variable
  ``QSCHEME_MAX_COPIED_FILE_BYTES`` sets another bound, a positive integer).

Anything else (a link leading out of the source, to a folder, to nothing, a FIFO, socket or
device file, a file over the bound) is refused with ``SourceFileError`` naming it, and nothing is
written. The copy reads each file through a descriptor opened without following links and
checked to be the same regular file as planned (device, inode), and copies at most its planned
size: a file swapped or grown meanwhile is refused, never copied unbounded.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from qscheme.errors import CheckpointError, DestinationError, UsageError

MAX_FILE_BYTES = 4 << 30
MAX_ENTRIES = 10_000
MAX_DEPTH = 16
SIZE_VARIABLE = "QSCHEME_MAX_COPIED_FILE_BYTES"
_CHUNK = 1 << 20


class SourceFileError(CheckpointError):
    """A file of the source folder that cannot be copied through safely (exit code 1)."""


@dataclass(frozen=True)
class OtherFile:
    """One entry to copy: its path relative to the source folder, and for a file what it resolves
    to (path, device, inode, size); a folder has ``real`` None."""

    relative: Path
    real: Path | None = None
    identity: tuple[int, int] = (0, 0)
    size: int = 0


def max_file_bytes() -> int:
    """The size bound for one copied file: ``QSCHEME_MAX_COPIED_FILE_BYTES`` or 4 GiB."""
    text = os.environ.get(SIZE_VARIABLE)
    if text is None or text == "":
        return MAX_FILE_BYTES
    if not text.strip().isdigit() or int(text) <= 0:
        raise UsageError(
            f"environment variable {SIZE_VARIABLE}={text!r}: must be a positive whole number of bytes "
            f"(default {MAX_FILE_BYTES}); unset it or give e.g. {MAX_FILE_BYTES}"
        )
    return int(text)


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def _allowed_roots(folder: Path) -> list[Path]:
    real = Path(os.path.realpath(folder))
    roots = [real]
    if folder.parent.name == "snapshots":  # a Hugging Face cache snapshot: its files link into ../../blobs
        roots.append(Path(os.path.realpath(folder.parent.parent / "blobs")))
    return roots


def plan_other_files(folder: Path, entries: list[Path]) -> list[OtherFile]:
    """Check the top-level ``entries`` of ``folder`` (and what folders hold) before anything is written."""
    roots = _allowed_roots(folder)
    bound = max_file_bytes()
    planned: list[OtherFile] = []
    pending = [(entry, 0) for entry in reversed(entries)]
    while pending:
        path, depth = pending.pop()
        if len(planned) >= MAX_ENTRIES:
            raise SourceFileError(
                f"{folder}: more than {MAX_ENTRIES} files and folders to copy besides the weights; move what the "
                "model does not need out of the checkpoint folder"
            )
        relative = path.relative_to(folder)
        try:
            info = path.lstat()
        except OSError as exc:
            raise SourceFileError(f"{path}: cannot be read: {exc.strerror}; nothing was written") from None
        if stat.S_ISDIR(info.st_mode):
            if depth >= MAX_DEPTH:
                raise SourceFileError(
                    f"{path}: folders nested more than {MAX_DEPTH} deep in the checkpoint folder; nothing was written"
                )
            planned.append(OtherFile(relative))
            try:
                children = sorted(path.iterdir(), reverse=True)
            except OSError as exc:
                raise SourceFileError(f"{path}: cannot be listed: {exc.strerror}; nothing was written") from None
            pending.extend((child, depth + 1) for child in children)
            continue
        real = path
        if stat.S_ISLNK(info.st_mode):
            real = Path(os.path.realpath(path))
            if not any(_within(real, root) for root in roots):
                raise SourceFileError(
                    f"{path}: a link to {real}, outside the checkpoint folder; only links to files inside it are "
                    "copied. Replace the link by a copy of the file, or remove it; nothing was written"
                )
            try:
                info = real.stat()
            except OSError as exc:
                raise SourceFileError(
                    f"{path}: a link to {real}, which cannot be read ({exc.strerror}); remove the link; nothing was "
                    "written"
                ) from None
        if not stat.S_ISREG(info.st_mode):
            raise SourceFileError(
                f"{path}: {_kind(info.st_mode)}, not a regular file; only regular files and folders are copied "
                "through. Remove it from the checkpoint folder; nothing was written"
            )
        if info.st_size > bound:
            raise SourceFileError(
                f"{path}: {info.st_size} bytes, over the {bound}-byte bound for a file copied through (set "
                f"{SIZE_VARIABLE} to allow more, or move the file out of the checkpoint folder); nothing was written"
            )
        planned.append(OtherFile(relative, real, (info.st_dev, info.st_ino), info.st_size))
    return planned


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device file"
    return "not a regular file"


def copy_other_files(files: list[OtherFile], folder: Path, output: Path) -> list[str]:
    """Copy the planned entries into ``output``; the top-level names copied. SourceFileError when a
    file changed since it was planned, DestinationError when the output cannot be written."""
    copied: list[str] = []
    for item in files:
        target = output / item.relative
        try:
            if item.real is None:
                target.mkdir()
            else:
                _copy_file(item, folder / item.relative, target)
        except OSError as exc:
            raise DestinationError(f"{target}: cannot be written: {exc.strerror or exc}") from None
        if len(item.relative.parts) == 1:
            copied.append(item.relative.name)
    return copied


def _copy_file(item: OtherFile, shown: Path, target: Path) -> None:
    assert item.real is not None
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        source = os.open(item.real, flags)
    except OSError as exc:
        raise SourceFileError(f"{shown}: cannot be opened: {exc.strerror}; nothing was written") from None
    try:
        info = os.fstat(source)
        if not stat.S_ISREG(info.st_mode) or (info.st_dev, info.st_ino) != item.identity:
            raise SourceFileError(f"{shown}: was replaced while the checkpoint was written; run again")
        with open(target, "xb") as out:
            remaining = item.size
            while remaining:
                chunk = os.read(source, min(_CHUNK, remaining))
                if not chunk:
                    raise SourceFileError(f"{shown}: shrank while it was copied; run again once it is complete")
                out.write(chunk)
                remaining -= len(chunk)
            if os.read(source, 1):
                raise SourceFileError(f"{shown}: grew while it was copied; run again once it is complete")
    finally:
        os.close(source)
