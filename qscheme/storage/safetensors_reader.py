"""Lazy access to a checkpoint's safetensors files: one model.safetensors, or shards + index.

Every file's header is parsed and checked (``safetensors_header.py``) and the index compared with the
shards (no tensor in two shards, none missing) before any tensor is read, so that a corrupt
file fails with a CheckpointError naming the file and the tensor.

Tensor data is then read on demand, one tensor at a time, into memory of its own (a plain
``read`` at the header's offsets, not a memory map): asking for one layer never reads the rest
of the model, and what a caller keeps never depends on the file staying as it was. A file
truncated or rewritten after its header was read gives a CheckpointError, never a SIGBUS.

The folder holds either model.safetensors or an index with its shards, never both (which one
the producer meant is unknown). An index must map at least one tensor, every shard it names
must be a regular file, and a shard-named file (``*-00001-of-00002.safetensors``) that it does
not mention is an error; other unmentioned .safetensors files are noted and not read.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import BinaryIO

import torch

from qscheme.errors import CheckpointError, UsageError
from qscheme.huge_pages import empty as empty_huge
from qscheme.storage.json_files import file_problem, read_json
from qscheme.storage.safetensors_header import (
    DTYPE_BY_TORCH_NAME,
    MAX_HEADER_BYTES,
    SAFETENSORS_DTYPES,
    FileHeader,
    TensorInfo,
    read_file_header,
    read_header,
)
from qscheme.text import listing, shown, shown_file

__all__ = [
    "INDEX_FILE",
    "MAX_HEADER_BYTES",
    "SAFETENSORS_DTYPES",
    "SINGLE_FILE",
    "CheckpointFiles",
    "TensorInfo",
    "read_header",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_NAME = re.compile(r".+-[0-9]+-of-[0-9]+\.safetensors")
_READ_CHUNK = 1 << 30  # one read() call moves at most this much (Linux stops near 2 GiB anyway)


def _is_file_name(shard: str) -> bool:
    """A plain file name in the folder: no path, no NUL, no lone surrogate (none can name a file)."""
    if not shard or shard in (".", "..") or "\0" in shard or "/" in shard or os.sep in shard:
        return False
    try:
        shard.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return Path(shard).name == shard


def refuse_empty_path(path: object, caller: str = "") -> None:
    """UsageError (exit code 2) for an empty path: ``Path("")`` is the current folder, which the
    caller never meant (an unset variable, a missing argument)."""
    if isinstance(path, str) and path == "":
        raise UsageError(
            f"{caller + ': ' if caller else ''}the checkpoint path is empty (''), which would name the current "
            "folder; pass the checkpoint folder (config.json + *.safetensors), or '.' for the current folder"
        )


class CheckpointFiles:
    """The tensors of a checkpoint folder, by name, read lazily from their files."""

    def __init__(self, folder: str | Path) -> None:
        refuse_empty_path(folder, "CheckpointFiles")
        self.folder = Path(folder)
        try:
            is_folder = self.folder.is_dir()
        except OSError as exc:
            raise CheckpointError(f"{self.folder}: cannot be accessed: {exc.strerror}") from None
        if not is_folder:
            raise CheckpointError(f"{self.folder}: not a folder; pass a checkpoint folder holding {SINGLE_FILE}")
        if not os.access(self.folder, os.R_OK | os.X_OK):
            raise CheckpointError(
                f"{self.folder}: folder is not readable (permission denied); give your user read and execute "
                f"access to it (chmod u+rx {self.folder})"
            )
        self.index_file: Path | None = None
        self.files: list[Path] = []
        self.tensors: dict[str, TensorInfo] = {}
        self.notes: list[str] = []
        self._headers: dict[Path, FileHeader] = {}
        index = self.folder / INDEX_FILE
        single = self.folder / SINGLE_FILE
        index_problem, single_problem = file_problem(index), file_problem(single)
        if index_problem not in (None, "missing"):
            raise CheckpointError(f"{index}: is {index_problem}; the index must be a regular JSON file")
        if index_problem is None and single_problem != "missing":
            raise CheckpointError(
                f"{self.folder}: has both {INDEX_FILE} (shards) and {SINGLE_FILE}; it is unknown which one holds "
                f"the weights: remove {SINGLE_FILE} if the shards are current, else remove the index and its shards"
            )
        if index_problem is None:
            self.index_file = index
            self._read_index(index)
        elif single_problem is None:
            self.files = [single]
            self.tensors = self._read_header(single)
        elif single_problem != "missing":
            raise CheckpointError(
                f"{single}: is {single_problem}; {SINGLE_FILE} must be a regular safetensors file "
                f"(or use {INDEX_FILE} with shards)"
            )
        else:
            found = sorted(p.name for p in self.folder.glob("*.safetensors*"))
            hint = f"; found {listing(found, 6)}" if found else ""
            raise CheckpointError(f"{self.folder}: has neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")

    def _read_index(self, index: Path) -> None:
        data = read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map is missing or not an object of tensor name -> shard file")
        if not weight_map:
            raise CheckpointError(
                f"{index}: weight_map is empty, so no tensor would be read; regenerate the index (save the model "
                "again) or remove it and keep a single model.safetensors"
            )
        by_shard: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            by_shard.setdefault(shard, []).append(name)
        for shard, names in sorted(by_shard.items()):
            if not _is_file_name(shard):
                raise CheckpointError(
                    f"{index}: shard {shard!r} (for {len(names)} tensors, e.g. {sorted(names)[0]!r}) is not a file "
                    "name in the checkpoint folder; the index must name shard files such as "
                    "'model-00001-of-00002.safetensors'"
                )
            problem = file_problem(self.folder / shard)
            if problem is not None:
                state = "does not exist" if problem == "missing" else f"is {problem}"
                raise CheckpointError(
                    f"{index}: names shard {shard!r} (for {len(names)} tensors, e.g. {sorted(names)[0]!r}) "
                    f"but {shown_file(self.folder / shard)} {state}"
                )
        for path in sorted(self.folder.glob("*.safetensors")):
            if path.name in by_shard:
                continue
            if SHARD_NAME.fullmatch(path.name):
                raise CheckpointError(
                    f"{index}: shard file {shown(path.name)} is in the folder but the index never mentions it; "
                    "its tensors would be skipped: regenerate the index, or delete the stale shard"
                )
            self.notes.append(f"{shown(path.name)} is not mentioned by {index.name}; it is not read")
        for shard, names in sorted(by_shard.items()):
            path = self.folder / shard
            header = self._read_header(path)
            missing = sorted(set(names) - set(header))
            if missing:
                raise CheckpointError(
                    f"{index}: maps tensor {missing[0]!r} to {shown(shard)} but that shard has no such tensor"
                    + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                )
            for name in sorted(set(header) - set(names)):
                other = weight_map.get(name)
                if other is not None:
                    raise CheckpointError(
                        f"{shown_file(path)}: tensor {name!r} is also in shard {shown(other)}; the index maps it there"
                    )
                raise CheckpointError(
                    f"{shown_file(path)}: tensor {name!r} is not listed in {index.name}; regenerate the index"
                )
            self.files.append(path)
            self.tensors.update(header)

    # ------------------------------------------------------------------ access

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def total_bytes(self) -> int:
        """The files' sizes when their headers were checked."""
        return sum(self._headers[path].size for path in self.files)

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def _read_header(self, path: Path) -> dict[str, TensorInfo]:
        header = read_file_header(path)
        self._headers[path] = header
        return header.tensors

    def get(self, name: str) -> torch.Tensor:
        """One tensor, read into memory of its own; CheckpointError naming the file on failure."""
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.folder}: no tensor named {name!r}")
        return read_checked_tensor(info, self._headers[info.file])

    def get_many(self, names: Mapping[str, str]) -> dict[str, torch.Tensor]:
        """{key: tensor} for {key: tensor name}."""
        return {key: self.get(name) for key, name in names.items()}

    def close(self) -> None:
        """Nothing to release: each ``get`` opens its file and closes it again."""

    def __enter__(self) -> CheckpointFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _changed(header: FileHeader, handle: BinaryIO) -> str | None:
    """How the open file differs from the one whose header was checked, or None."""
    stat = os.fstat(handle.fileno())
    if stat.st_size != header.size:
        return f"its size changed from {header.size} to {stat.st_size} bytes"
    if (stat.st_dev, stat.st_ino, stat.st_mtime_ns) != header.identity:
        return "it was rewritten"
    return None


@functools.cache
def memory_bytes() -> int:
    """This machine's memory, physical plus swap (0 when unknown): no tensor larger than this
    can be read into memory. Read once per process (every tensor read asks)."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 0
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("SwapTotal:"):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return int(total)


_TOO_LARGE_FIX = "the header claims more data than a real checkpoint's tensor holds: re-download or re-export the file"


def _tensor_label(info: TensorInfo) -> str:
    return f"{shown_file(info.file)}: tensor {info.name!r} ({info.dtype} x {list(info.shape)})"


def too_large(info: TensorInfo, memory: int, wanted: int | None = None) -> str | None:
    """Why ``wanted`` bytes (default: the whole tensor's) of ``info`` cannot be read on a machine
    of ``memory`` bytes (0: unknown), or None."""
    wanted = info.nbytes if wanted is None else wanted
    if not memory or wanted <= memory:
        return None
    return (
        f"{_tensor_label(info)}: reading it needs {wanted:,} bytes, more than this machine's {memory:,} bytes of "
        f"memory (physical plus swap); {_TOO_LARGE_FIX}"
    )


def allocate_bytes(info: TensorInfo, count: int | None = None) -> torch.Tensor:
    """``count`` (default: all of the tensor's) uninitialised bytes to read ``info`` into; a
    CheckpointError naming the file, the tensor and the bytes when they cannot be had: more than
    this machine's memory (``memory_bytes``), or refused by the allocator. A header may claim
    any size a sparse file can hold (terabytes), so this is where a hostile shape is stopped."""
    wanted = info.nbytes if count is None else count
    problem = too_large(info, memory_bytes(), wanted)
    if problem is not None:
        raise CheckpointError(problem)
    try:
        return empty_huge(wanted, torch.uint8)
    except (RuntimeError, MemoryError) as exc:  # torch's allocator: RuntimeError "can't allocate memory"
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        raise CheckpointError(
            f"{_tensor_label(info)}: {wanted:,} bytes could not be allocated to read it ({type(exc).__name__}: "
            f"{shown(first_line, 160)}); free memory, or {_TOO_LARGE_FIX}"
        ) from None


def read_checked_tensor(info: TensorInfo, header: FileHeader) -> torch.Tensor:
    """One tensor of a file whose ``header`` was checked, read into memory of its own; a
    CheckpointError naming the file when it was rewritten or truncated since, cannot be read,
    or cannot be allocated (``allocate_bytes``). A file of its own per read: no handle outlives
    the call, and threads never share a position."""
    dtype = DTYPE_BY_TORCH_NAME[info.dtype].torch_dtype
    assert dtype is not None  # read_file_header refuses dtypes torch lacks
    data = allocate_bytes(info)
    view = data.numpy().data.cast("B")
    try:
        with info.file.open("rb", buffering=0) as handle:
            change = _changed(header, handle)
            if change is not None:
                raise CheckpointError(
                    f"{shown_file(info.file)}: tensor {info.name!r} cannot be read: {change}: the file changed since "
                    "its header was checked (another program writes the checkpoint?); load it again once the file is "
                    "complete"
                )
            handle.seek(info.offset)
            done = 0
            while done < len(view):
                count = handle.readinto(view[done : done + _READ_CHUNK])
                if not count:
                    raise CheckpointError(
                        f"{shown_file(info.file)}: tensor {info.name!r}: the file ends at byte {info.offset + done}, "
                        "inside the tensor; it was truncated after its header was checked: load it again once it is "
                        "complete"
                    )
                done += count
    except OSError as exc:
        raise CheckpointError(f"{shown_file(info.file)}: tensor {info.name!r} cannot be read: {exc.strerror}") from None
    shape = list(info.shape)
    if DTYPE_BY_TORCH_NAME[info.dtype].bits == 4:
        shape[-1] //= 2  # two FP4 values per torch element
    return data.view(dtype).reshape(shape)
