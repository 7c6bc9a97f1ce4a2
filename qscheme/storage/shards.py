"""Writing safetensors shards and their index, recording a digest of every tensor written.

``write_shard`` writes the safetensors format directly (an 8-byte little-endian header length,
the JSON header padded with spaces to a multiple of 8, then the tensors' bytes in order): each
tensor goes from its own memory to the file once, with no staging copy, and its CRC-32 is taken
on the way so that ``verify`` can re-read the file and compare. Bytes that do not change
(``RawSpan``, see ``bytes_copy``) are copied by the kernel from the source file instead, and
recorded with their source range, which ``verify`` compares them with. Output metadata is
``{"format": "pt"}``, as torch's ``save_file`` writes it. ``write_index`` writes
``model.safetensors.index.json`` as transformers does (``metadata.total_size``, ``weight_map``).
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from qscheme.errors import DestinationError
from qscheme.storage.bytes_copy import RawSpan, copy_span
from qscheme.storage.json_files import write_json
from qscheme.storage.safetensors_header import DTYPE_BY_TORCH_NAME
from qscheme.storage.safetensors_reader import INDEX_FILE

DEFAULT_METADATA = {"format": "pt"}
_WRITE_CHUNK = 1 << 22  # small enough that the CRC leaves each chunk in the CPU cache for the write


@dataclass(frozen=True)
class TensorRecord:
    """What was written for one tensor: safetensors dtype code, header shape, byte span, and what to
    check it against: its CRC-32, or for bytes copied from a source file the source range."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # byte offset in the data section
    end: int
    crc32: int  # of the bytes written (0 for a copied span: see ``same_as``)
    same_as: tuple[Path, int] | None = None  # a RawSpan's (source file, offset): verify compares with it


@dataclass(frozen=True)
class ShardRecord:
    """One written shard: its file, its tensors in file order, and its size in bytes."""

    path: Path
    tensors: tuple[TensorRecord, ...]
    metadata: Mapping[str, str]
    size: int

    @property
    def data_bytes(self) -> int:
        return sum(record.end - record.start for record in self.tensors)


def dtype_code(tensor: Tensor) -> tuple[str, int]:
    """(safetensors dtype code, bits per element) for a tensor's dtype; DestinationError if it has none."""
    name = str(tensor.dtype).removeprefix("torch.")
    found = DTYPE_BY_TORCH_NAME.get(name)
    if found is None:
        raise DestinationError(f"tensor dtype {tensor.dtype} has no safetensors code; it cannot be written")
    return found.code, found.bits


def tensor_bytes(tensor: Tensor) -> Tensor:
    """The tensor's bytes as a flat uint8 CPU tensor (no copy when it is contiguous on the CPU)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.dtype == torch.uint8:
        return flat
    return flat.view(torch.uint8)


def write_shard(
    path: str | Path,
    tensors: Mapping[str, Tensor | RawSpan],
    metadata: Mapping[str, str] | None = None,
    *,
    fsync: bool = True,
) -> ShardRecord:
    """Write ``tensors`` (in their order) to a safetensors file at ``path``; DestinationError on failure.

    A value is a tensor, or a ``RawSpan`` (bytes viewing a source file, written as they are under
    the span's dtype code and shape). ``fsync=False`` leaves flushing the file to the caller
    (``sync_file``), e.g. in another thread while the next shard is written.
    """
    path = Path(path)
    metadata = dict(DEFAULT_METADATA if metadata is None else metadata)
    header: dict[str, object] = {"__metadata__": metadata}
    layout: list[tuple[str, str, tuple[int, ...], int, int, memoryview | RawSpan]] = []
    offset = 0
    for name, tensor in tensors.items():
        view: memoryview | RawSpan
        if isinstance(tensor, RawSpan):
            code, shape, view = tensor.dtype, tuple(tensor.shape), tensor
        else:
            code, bits = dtype_code(tensor)
            shape = tuple(int(size) for size in tensor.shape)
            if bits == 4:  # torch holds two FP4 values per element along the last dimension
                shape = (*shape[:-1], shape[-1] * 2)
            view = tensor_bytes(tensor).numpy().data.cast("B")
        end = offset + view.nbytes
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, end]}
        layout.append((name, code, shape, offset, end, view))
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    records = []
    sources: dict[Path, int] = {}
    try:
        with open(path, "wb", buffering=0) as handle:
            descriptor = handle.fileno()
            _write_all(descriptor, struct.pack("<Q", len(text)) + text)
            for name, code, shape, start, end, view in layout:
                if isinstance(view, RawSpan):
                    if view.path not in sources:
                        sources[view.path] = os.open(view.path, os.O_RDONLY)
                    copy_span(view, sources[view.path], descriptor)
                    records.append(TensorRecord(name, code, shape, start, end, 0, (view.path, view.offset)))
                    continue
                crc = 0
                for begin in range(0, len(view), _WRITE_CHUNK):
                    chunk = view[begin : begin + _WRITE_CHUNK]
                    crc = zlib.crc32(chunk, crc)  # first: the chunk is then in the CPU cache for the write
                    _write_all(descriptor, chunk)
                records.append(TensorRecord(name, code, shape, start, end, crc))
            if fsync:
                os.fsync(descriptor)
    except OSError as exc:
        raise DestinationError(f"{path}: cannot write the shard: {exc.strerror or exc}") from None
    finally:
        for source in sources.values():
            os.close(source)
    return ShardRecord(path=path, tensors=tuple(records), metadata=metadata, size=8 + len(text) + offset)


def _write_all(descriptor: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view.nbytes:
        written = os.write(descriptor, view)
        view = view[written:]


def sync_file(path: str | Path) -> None:
    """Flush a written file to the disk (``fsync``); DestinationError on failure."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
    except OSError as exc:
        raise DestinationError(f"{path}: cannot flush the shard to the disk: {exc.strerror}") from None


def write_index(folder: str | Path, weight_map: Mapping[str, str], total_size: int) -> Path:
    """``model.safetensors.index.json`` in ``folder``: ``{"metadata": {"total_size"}, "weight_map"}``."""
    path = Path(folder) / INDEX_FILE
    write_json(path, {"metadata": {"total_size": int(total_size)}, "weight_map": dict(sorted(weight_map.items()))})
    return path
