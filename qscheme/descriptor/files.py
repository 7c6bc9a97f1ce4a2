"""Reading a descriptor file without hanging on it or reading without end.

A path named on the command line or found on QSCHEME_SCHEME_PATH may be a FIFO (opening it
blocks until a writer comes), a device (``/dev/zero`` never ends), a socket, a dangling or
looping symlink, or a file of gigabytes. Each is a SchemeError naming the path and what it is,
found from the file type before anything is opened; the bytes read are capped.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

from qscheme.errors import Location, Problem, SchemeError

MAX_DESCRIPTOR_BYTES = 1 << 20
"""Largest descriptor file read (1 MiB); the built-in ones are 1-3 KB."""

MAX_EMBEDDED_DESCRIPTOR_BYTES = 256 * 1024
"""Largest descriptor a self-describing checkpoint's config.json may embed (256 KiB of UTF-8):
the config comes with a downloaded checkpoint, so its size is the checkpoint author's choice,
and the embedded text is parsed (and its problems listed) whenever the checkpoint is read."""

_KINDS: tuple[tuple[Callable[[int], bool], str], ...] = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def file_kind(mode: int) -> str:
    """What a stat mode is, in words, for a file that is not a regular one."""
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def path_problem(path: Path) -> str | None:
    """Why ``path`` cannot be read as a descriptor (type and size only, nothing opened); None if it can."""
    try:
        info = path.stat()
    except OSError as exc:
        return _stat_problem(path, exc)
    if not stat.S_ISREG(info.st_mode):
        return f"is {file_kind(info.st_mode)}, not a descriptor file; pass a regular .yaml file"
    if info.st_size > MAX_DESCRIPTOR_BYTES:
        return _too_large(info.st_size)
    return None


def read_descriptor_bytes(path: str | Path) -> bytes:
    """The bytes of a descriptor file: SchemeError for anything but a regular file of at most
    MAX_DESCRIPTOR_BYTES (checked before opening, and again on the opened file, so a file
    swapped for a FIFO in between cannot block)."""
    file = Path(path)
    problem = path_problem(file)
    if problem is not None:
        raise _error(file, problem)
    try:
        descriptor = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise _error(file, _stat_problem(file, exc)) from None
    with os.fdopen(descriptor, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise _error(file, f"is {file_kind(info.st_mode)}, not a descriptor file; pass a regular .yaml file")
        # /proc-like files report size 0 and may be long: the read itself is capped too.
        data = handle.read(MAX_DESCRIPTOR_BYTES + 1)
    if len(data) > MAX_DESCRIPTOR_BYTES:
        raise _error(file, _too_large(None))
    return data


def read_descriptor_text(path: str | Path) -> str:
    """The UTF-8 text of a descriptor file (see ``read_descriptor_bytes``)."""
    data = read_descriptor_bytes(path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _error(
            Path(path), f"is not UTF-8 text (byte {exc.start}: {exc.reason}); save the descriptor as UTF-8"
        ) from None


def _too_large(size: int | None) -> str:
    found = f"{size} bytes" if size is not None else f"more than {MAX_DESCRIPTOR_BYTES} bytes"
    return (
        f"is {found}; a descriptor is at most {MAX_DESCRIPTOR_BYTES} bytes (1 MiB): "
        "pass the scheme's own .yaml file, one scheme per file"
    )


def _stat_problem(path: Path, exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "is a symlink loop; point the link at a real descriptor file, or remove it"
    if exc.errno == errno.ENOENT and path.is_symlink():
        target = os.readlink(path)
        return f"is a symlink to {target!r}, which does not exist; fix the link or remove it"
    if exc.errno == errno.ENOENT:
        return "does not exist; check the path"
    reason = exc.strerror or str(exc)
    return f"cannot be read: {reason}; make it readable (chmod +r), or move it away"


def _error(path: Path, problem: str) -> SchemeError:
    return SchemeError([Problem(Location(str(path)), problem)])
