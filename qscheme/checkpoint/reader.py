"""Lazy access to a checkpoint's safetensors files: one model.safetensors, or shards + index.

The headers are parsed and checked here (offsets inside the file, sizes matching dtype x shape,
no overlaps, no duplicate names across shards, index and shards agreeing) before any tensor is
read, so that a corrupt file fails with a CheckpointError naming the file and the tensor.
Tensor data is then read through ``safetensors.safe_open`` (memory-mapped, zero-copy on CPU):
asking for one layer never reads the rest of the model.

The folder holds either model.safetensors or an index with its shards, never both (which one
the producer meant is unknown). An index must map at least one tensor, every shard it names
must be a regular file, and a shard-named file (``*-00001-of-00002.safetensors``) that it does
not mention is an error; other unmentioned .safetensors files are noted and not read.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from qscheme.checkpoint.config import file_problem, read_json
from qscheme.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024
SHARD_NAME = re.compile(r".+-[0-9]+-of-[0-9]+\.safetensors")

# safetensors dtype codes -> (torch dtype name, bytes per element)
SAFETENSORS_DTYPES: dict[str, tuple[str, float]] = {
    "BOOL": ("bool", 1),
    "U8": ("uint8", 1),
    "I8": ("int8", 1),
    "U16": ("uint16", 2),
    "I16": ("int16", 2),
    "U32": ("uint32", 4),
    "I32": ("int32", 4),
    "U64": ("uint64", 8),
    "I64": ("int64", 8),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "F32": ("float32", 4),
    "F64": ("float64", 8),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "E8M0": ("float8_e8m0fnu", 1),
    "F4": ("float4_e2m1fn_x2", 0.5),
}


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's header entry: its dtype (torch name), shape and the file holding it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def nbytes(self) -> int:
        return int(self.numel * SAFETENSORS_DTYPES_BY_TORCH[self.dtype])


SAFETENSORS_DTYPES_BY_TORCH: dict[str, float] = {name: size for name, size in SAFETENSORS_DTYPES.values()}


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and check one safetensors header; CheckpointError naming the file and tensor."""
    try:
        file_size = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: truncated: {file_size} bytes, shorter than the 8-byte header length")
            (header_size,) = struct.unpack("<Q", prefix)
            if header_size > min(MAX_HEADER_BYTES, file_size - 8):
                raise CheckpointError(
                    f"{path}: header length field says {header_size} bytes but the file has {file_size - 8} "
                    "after it (truncated or not a safetensors file)"
                )
            raw = handle.read(header_size)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read: {exc.strerror}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: the safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    data_size = file_size - 8 - header_size
    infos: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        infos[name] = _tensor_info(path, name, entry, data_size, spans)
    spans.sort()
    for (_, end, first), (start, _, second) in itertools.pairwise(spans):
        if start < end:
            raise CheckpointError(f"{path}: tensors {first!r} and {second!r} overlap in the data section (bad offsets)")
    return infos


def _tensor_info(path: Path, name: str, entry: Any, data_size: int, spans: list[tuple[int, int, str]]) -> TensorInfo:
    if not isinstance(entry, dict):
        raise CheckpointError(f"{path}: tensor {name!r}: header entry is not an object")
    code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if code not in SAFETENSORS_DTYPES:
        raise CheckpointError(
            f"{path}: tensor {name!r}: unknown dtype {code!r}; known: {', '.join(SAFETENSORS_DTYPES)}"
        )
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise CheckpointError(f"{path}: tensor {name!r}: shape {shape!r} is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise CheckpointError(f"{path}: tensor {name!r}: data_offsets {offsets!r} is not [begin, end]")
    begin, end = offsets
    dtype, itemsize = SAFETENSORS_DTYPES[code]
    info = TensorInfo(name=name, dtype=dtype, shape=tuple(shape), file=path)
    expected = int(info.numel * itemsize)
    if not 0 <= begin <= end:
        raise CheckpointError(f"{path}: tensor {name!r}: data_offsets [{begin}, {end}] are not increasing")
    if end - begin != expected:
        raise CheckpointError(
            f"{path}: tensor {name!r}: header says {end - begin} bytes (offsets [{begin}, {end}]) but "
            f"{code} x {list(shape)} needs {expected}"
        )
    if end > data_size:
        raise CheckpointError(
            f"{path}: tensor {name!r}: data ends at byte {end} of the data section but the file holds only "
            f"{data_size} bytes there (file truncated, or the header lies about offsets)"
        )
    spans.append((begin, end, name))
    return info


class CheckpointFiles:
    """The tensors of a checkpoint folder, by name, read lazily from their files."""

    def __init__(self, folder: str | Path) -> None:
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
        self._handles: dict[Path, Any] = {}
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
            self.tensors = read_header(single)
        elif single_problem != "missing":
            raise CheckpointError(
                f"{single}: is {single_problem}; {SINGLE_FILE} must be a regular safetensors file "
                f"(or use {INDEX_FILE} with shards)"
            )
        else:
            found = sorted(p.name for p in self.folder.glob("*.safetensors*"))
            hint = f"; found {', '.join(found)}" if found else ""
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
            if not shard or shard in (".", "..") or Path(shard).name != shard:
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
                    f"but {self.folder / shard} {state}"
                )
        for path in sorted(self.folder.glob("*.safetensors")):
            if path.name in by_shard:
                continue
            if SHARD_NAME.fullmatch(path.name):
                raise CheckpointError(
                    f"{index}: shard file {path.name} is in the folder but the index never mentions it; "
                    "its tensors would be skipped: regenerate the index, or delete the stale shard"
                )
            self.notes.append(f"{path.name} is not mentioned by {index.name}; it is not read")
        for shard, names in sorted(by_shard.items()):
            path = self.folder / shard
            header = read_header(path)
            missing = sorted(set(names) - set(header))
            if missing:
                raise CheckpointError(
                    f"{index}: maps tensor {missing[0]!r} to {shard} but that shard has no such tensor"
                    + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                )
            for name in sorted(set(header) - set(names)):
                other = weight_map.get(name)
                if other is not None:
                    raise CheckpointError(f"{path}: tensor {name!r} is also in shard {other}; the index maps it there")
                raise CheckpointError(f"{path}: tensor {name!r} is not listed in {index.name}; regenerate the index")
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
        return sum(path.stat().st_size for path in self.files)

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def _handle(self, path: Path) -> Any:
        handle = self._handles.get(path)
        if handle is None:
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"{path}: cannot be opened as safetensors: {exc}") from None
            self._handles[path] = handle
        return handle

    def get(self, name: str) -> torch.Tensor:
        """One tensor (memory-mapped on CPU); CheckpointError naming the file on failure."""
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.folder}: no tensor named {name!r}")
        try:
            return self._handle(info.file).get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise CheckpointError(f"{info.file}: tensor {name!r} cannot be read: {exc}") from None

    def get_many(self, names: Mapping[str, str]) -> dict[str, torch.Tensor]:
        """{key: tensor} for {key: tensor name}."""
        return {key: self.get(name) for key, name in names.items()}

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> CheckpointFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
