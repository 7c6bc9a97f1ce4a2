"""Which run owns a temporary output folder, so that only a dead run's folder is ever removed.

A run writes ``OWNER_FILE`` into its partial folder: its process id, the process's start time,
the machine's boot id and the process-id namespace (Linux ``/proc``). A later run for the same
DST removes a partial folder only when all of these hold:

- its name is exactly ``.<DST name>.qscheme-partial-<pid>-<token>`` (parsed, not globbed);
- its owner file parses and names that pid and token;
- it was written on this boot of this machine, in this process-id namespace (another container
  or machine sharing the file system has other ids: its folders are never touched);
- that process no longer exists, or a process with its id started at another time (id reuse).

Anything else (no owner file, another machine, a live owner, not Linux) is left alone. The owner
file is deleted just before the folder is renamed into place, so no output carries it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

OWNER_FILE = ".qscheme-owner.json"
_TOKEN = re.compile(r"(\d+)-([0-9a-f]{12})")


@dataclass(frozen=True)
class Owner:
    """A run's identity: process id and start time, boot id, process-id namespace, folder token."""

    pid: int
    start_time: str
    boot_id: str
    pid_namespace: str
    token: str


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii") as handle:
            return handle.read(4096).strip()
    except (OSError, ValueError):
        return ""


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22); "" when unknown."""
    text = _read(f"/proc/{pid}/stat")
    fields = text.rpartition(")")[2].split()
    return fields[19] if len(fields) > 19 else ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def this_run(token: str) -> Owner:
    """The current process's identity, with the partial folder's ``token``."""
    pid = os.getpid()
    return Owner(pid, _start_time(pid), _read("/proc/sys/kernel/random/boot_id"), _pid_namespace(), token)


def write_owner(folder: Path, owner: Owner) -> None:
    with open(folder / OWNER_FILE, "x", encoding="utf-8") as handle:
        json.dump(asdict(owner), handle)


def remove_owner(folder: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (folder / OWNER_FILE).unlink()


def _recorded(folder: Path) -> Owner | None:
    try:
        with open(folder / OWNER_FILE, encoding="utf-8") as handle:
            data = json.loads(handle.read(4096))
        return Owner(**data) if isinstance(data, dict) else None
    except (OSError, ValueError, TypeError):
        return None


def is_dead_run(folder: Path, prefix: str, me: Owner) -> bool:
    """Whether ``folder`` is a partial folder of a run of this machine and namespace that is gone."""
    name = folder.name
    if not name.startswith(prefix) or folder.is_symlink() or not folder.is_dir():
        return False
    match = _TOKEN.fullmatch(name[len(prefix) :])
    if match is None:
        return False
    owner = _recorded(folder)
    if owner is None or (owner.pid, owner.token) != (int(match.group(1)), name[len(prefix) :]):
        return False
    if (
        not me.boot_id
        or not me.pid_namespace
        or (owner.boot_id, owner.pid_namespace)
        != (
            me.boot_id,
            me.pid_namespace,
        )
    ):
        return False
    if owner.pid == me.pid:
        return False
    alive = _start_time(owner.pid)
    return alive == "" or alive != owner.start_time


def remove_dead_runs(parent: Path, prefix: str, me: Owner) -> list[Path]:
    """Delete the partial folders in ``parent`` named ``prefix<pid>-<token>`` whose run is gone."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        if entry.name.startswith(prefix) and is_dead_run(Path(entry.path), prefix, me):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
    return removed
