"""Re-read a written checkpoint folder before it is renamed into place.

Every shard's header is parsed with the loader's own checks (``read_file_header``) and must list
exactly the tensors recorded while writing (names, dtypes, shapes, byte spans); every tensor's
bytes are read back and their CRC-32 compared with the one taken while writing (a tensor copied
unchanged from a source file is compared byte for byte with its source range instead). The index must
map exactly those tensors to their shards, and ``config.json`` / ``hf_quant_config.json`` must
parse. Any difference is a DestinationError naming the file and the tensor, and the folder is then
never renamed to DST.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

from qscheme.checkpoint.config import CONFIG_FILES
from qscheme.errors import CheckpointError, DestinationError
from qscheme.storage import (
    INDEX_FILE,
    ShardRecord,
    TensorInfo,
    TensorRecord,
    config_file_present,
    first_difference,
    read_file_header,
    read_json,
)

_READ_CHUNK = 1 << 22


def verify_folder(folder: str | Path, shards: Sequence[ShardRecord], *, reread: bool = True) -> int:
    """Check the written folder against the shard records; the bytes re-read, or DestinationError.

    ``reread=False`` leaves the shards' bytes to the caller, who re-read each with ``verify_shard``
    (e.g. in another thread as soon as it was written); the headers, index and configs are
    checked here all the same."""
    folder = Path(folder)
    read = 0
    for record in shards:
        if reread:
            read += verify_shard(record)
        else:
            _verify_header(record)
    _verify_index(folder, shards)
    for name in CONFIG_FILES:
        path = folder / name
        try:
            if config_file_present(path):
                read_json(path)
        except CheckpointError as exc:
            raise DestinationError(f"{path}: the written file does not read back: {exc}") from None
    return read


def _verify_header(record: ShardRecord) -> tuple[int, Mapping[str, TensorInfo]]:
    """(the data section's offset, the header's tensors), checked against the record."""
    path = record.path
    try:
        header = read_file_header(path)
    except CheckpointError as exc:
        raise DestinationError(f"{path}: the written shard does not read back: {exc}") from None
    expected = {tensor.name: tensor for tensor in record.tensors}
    if set(header.tensors) != set(expected):
        missing = sorted(set(expected) - set(header.tensors))
        extra = sorted(set(header.tensors) - set(expected))
        raise DestinationError(
            f"{path}: the written shard lists other tensors than written (missing {missing}, extra {extra})"
        )
    data_start = header.size - record.data_bytes
    for tensor in record.tensors:
        info = header.tensors[tensor.name]
        if tuple(info.shape) != tensor.shape or info.offset != data_start + tensor.start:
            raise DestinationError(
                f"{path}: tensor {tensor.name!r} reads back as shape {list(info.shape)} at byte {info.offset}, "
                f"written as {list(tensor.shape)} at byte {data_start + tensor.start}"
            )
    return data_start, header.tensors


def verify_shard(record: ShardRecord) -> int:
    """Re-read one written shard: its header against the record, every tensor's bytes against
    the CRC-32 taken while writing (a tensor copied from a source file: against its source range,
    byte for byte); the bytes re-read, or DestinationError naming the tensor. Reads into one
    small reused buffer, so that each chunk's CRC runs from the CPU cache."""
    path = record.path
    data_start, _ = _verify_header(record)
    read = 0
    buffer = bytearray(min(_READ_CHUNK, max(1, record.data_bytes)))
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as handle:
        for tensor in record.tensors:
            if tensor.same_as is not None:
                read += _compare_copied(path, data_start, tensor)
                continue
            handle.seek(data_start + tensor.start)
            remaining = tensor.end - tensor.start
            crc = 0
            while remaining:
                count = handle.readinto(view[: min(remaining, len(view))])
                if not count:
                    raise DestinationError(f"{path}: tensor {tensor.name!r}: the file ends inside the tensor")
                crc = zlib.crc32(view[:count], crc)
                remaining -= count
            read += tensor.end - tensor.start
            if crc != tensor.crc32:
                raise DestinationError(
                    f"{path}: tensor {tensor.name!r} reads back with other bytes than were written (CRC-32 "
                    f"{crc:08x}, written {tensor.crc32:08x}); the disk or file system corrupted it: nothing was "
                    "moved into place"
                )
    return read


def _compare_copied(path: Path, data_start: int, tensor: TensorRecord) -> int:
    """A tensor copied from a source file: re-read and compared byte for byte with its source."""
    assert tensor.same_as is not None
    source, offset = tensor.same_as
    size = tensor.end - tensor.start
    try:
        found = first_difference(path, data_start + tensor.start, source, offset, size)
    except OSError as exc:
        raise DestinationError(f"{path}: tensor {tensor.name!r} cannot be read back: {exc.strerror or exc}") from None
    if found is not None:
        raise DestinationError(
            f"{path}: tensor {tensor.name!r} reads back with other bytes than its source {source} (first "
            f"difference at byte {found} of {size}); the disk or file system corrupted it, or the source changed "
            "while it was copied: nothing was moved into place"
        )
    return size


def _verify_index(folder: Path, shards: Sequence[ShardRecord]) -> None:
    index = folder / INDEX_FILE
    if not index.exists():
        if len(shards) > 1:
            raise DestinationError(f"{folder}: {len(shards)} shards were written but no {INDEX_FILE}")
        return
    try:
        data = read_json(index)
    except CheckpointError as exc:
        raise DestinationError(f"{index}: the written index does not read back: {exc}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    expected = {tensor.name: record.path.name for record in shards for tensor in record.tensors}
    if weight_map != expected:
        raise DestinationError(f"{index}: the written weight_map does not match the shards written")
