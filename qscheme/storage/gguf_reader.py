"""A GGUF tensor's raw bytes, or a range of its rows, read on demand into memory of its own.

As ``safetensors_reader`` reads safetensors tensors: a plain read (``os.preadv``) at the offsets
``read_gguf_header`` checked, straight into the result's memory, no memory map; so asking for
one layer never reads the rest of the model, what a caller keeps never depends on the file
staying as it was, and a file truncated or rewritten since its header was read gives a
CheckpointError, never a SIGBUS. Reading runs at the speed of the file's reads (one call per
GiB).

A ggml tensor's bytes are rows: one row is a run of dims[0] values (K of a weight, in
``row_bytes`` bytes, whole quantization blocks), and ``rows`` of them follow each other. The
result is a uint8 tensor [*shape[:-1], row_bytes]: [N, row_bytes] for a weight [N, K],
[E, N, row_bytes] for stacked experts [E, N, K]. ``rows`` (for tensor parallelism) selects a
range of the flattened rows (for [E, N, K]: row e * N + n) and gives [count, row_bytes].
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import BinaryIO

import torch

from qscheme.errors import CheckpointError, UsageError
from qscheme.huge_pages import empty as empty_huge
from qscheme.storage.gguf_header import GGUFHeader, GGUFTensorInfo
from qscheme.storage.safetensors_reader import memory_bytes
from qscheme.text import listing, shown, shown_file

__all__ = ["read_gguf_tensor"]

_READ_CHUNK = 1 << 30  # one read moves at most this much (Linux stops near 2 GiB anyway)
_IOV_MAX = 1024  # buffers per preadv (POSIX's IOV_MAX on Linux)


def _after(pieces: list[memoryview], got: int) -> list[memoryview]:
    """The buffers still to fill once ``got`` bytes went into the first ones (a read may stop short)."""
    index = 0
    while index < len(pieces) and got >= len(pieces[index]):
        got -= len(pieces[index])
        index += 1
    rest = pieces[index:]
    if rest and got:
        rest[0] = rest[0][got:]
    return rest


_FIX = "the header claims more data than a real model's tensor holds: re-download or re-convert the file"


def _label(header: GGUFHeader, info: GGUFTensorInfo) -> str:
    return f"{shown_file(header.path)}: tensor '{shown(info.name)}' ({info.type.name} x {list(info.shape)})"


def _row_range(header: GGUFHeader, info: GGUFTensorInfo, rows: slice | None) -> tuple[int, int]:
    if rows is None:
        return 0, info.rows
    if not isinstance(rows, slice):
        raise UsageError(f"{_label(header, info)}: rows must be a slice of row indices or None, not {rows!r}")
    start = 0 if rows.start is None else rows.start
    stop = info.rows if rows.stop is None else rows.stop
    valid = all(type(v) is int for v in (start, stop)) and rows.step in (None, 1)
    if not valid or not 0 <= start <= stop <= info.rows:
        raise UsageError(
            f"{_label(header, info)}: rows {rows!r} is not a range of its {info.rows} rows; pass slice(start, stop) "
            f"with 0 <= start <= stop <= {info.rows} and no step"
        )
    return start, stop


def _allocate(header: GGUFHeader, info: GGUFTensorInfo, count: int) -> torch.Tensor:
    memory = memory_bytes()
    if memory and count > memory:
        raise CheckpointError(
            f"{_label(header, info)}: reading it needs {count:,} bytes, more than this machine's {memory:,} bytes of "
            f"memory (physical plus swap); {_FIX}"
        )
    try:
        return empty_huge(count, torch.uint8)
    except (RuntimeError, MemoryError) as exc:
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        raise CheckpointError(
            f"{_label(header, info)}: {count:,} bytes could not be allocated to read it ({type(exc).__name__}: "
            f"{shown(first_line, 160)}); free memory, or {_FIX}"
        ) from None


def _changed(header: GGUFHeader, handle: BinaryIO) -> str | None:
    stat = os.fstat(handle.fileno())
    if stat.st_size != header.file_size:
        return f"its size changed from {header.file_size} to {stat.st_size} bytes"
    if header.identity != (0, 0, 0) and (stat.st_dev, stat.st_ino, stat.st_mtime_ns) != header.identity:
        return "it was rewritten"
    return None


def _destinations(view: memoryview, row_bytes: int, count: int, row_order: Sequence[int] | None) -> list[memoryview]:
    """Where the bytes read in file order go: the whole buffer in chunks, or with ``row_order``
    (destination row i holds the i-th read row ``row_order[i]``) one slice per row, in file order."""
    if row_order is None:
        return [view[start : start + _READ_CHUNK] for start in range(0, count, _READ_CHUNK)]
    rows = count // row_bytes
    if len(row_order) != rows or sorted(row_order) != list(range(rows)):
        raise UsageError(f"row_order must be a permutation of the {rows} rows read, got {len(row_order)} entries")
    place = [0] * rows
    for destination, source in enumerate(row_order):
        place[source] = destination
    return [view[at * row_bytes : (at + 1) * row_bytes] for at in place]


def read_gguf_tensor(
    header: GGUFHeader, name: str, rows: slice | None = None, row_order: Sequence[int] | None = None
) -> torch.Tensor:
    """The raw bytes of tensor ``name`` (or of its flattened rows ``rows``) as a uint8 tensor
    [*shape[:-1], row_bytes] (with ``rows``: [count, row_bytes]), read into memory of its own.
    ``row_order``: the rows read are placed in this order (row i of the result is the read row
    ``row_order[i]``, as ``index_select`` would give), straight from the file: no second copy.

    CheckpointError naming the file and tensor when there is no such tensor, the file changed or
    was truncated since ``header`` was read, or the bytes cannot be allocated; UsageError for a
    ``rows`` that is not a range of the tensor's rows, or a ``row_order`` that is not a
    permutation of them.
    """
    info = header.tensors.get(name)
    if info is None:
        raise CheckpointError(
            f"{shown_file(header.path)}: no tensor named '{shown(name)}'; it holds "
            f"{listing(list(header.tensors), 5, sentence=True) or 'no tensor'}"
        )
    start, stop = _row_range(header, info, rows)
    row_bytes = info.row_bytes
    count = (stop - start) * row_bytes
    data = _allocate(header, info, count)
    view = data.numpy().data.cast("B")
    pieces = _destinations(view, row_bytes, count, row_order)
    offset = info.offset + start * row_bytes
    try:
        with header.path.open("rb", buffering=0) as handle:
            change = _changed(header, handle)
            if change is not None:
                raise CheckpointError(
                    f"{_label(header, info)} cannot be read: {change}: the file changed since its header was checked "
                    "(another program writes it?); read it again once the file is complete"
                )
            fd = handle.fileno()
            done = 0
            while pieces:
                batch = pieces[:_IOV_MAX]
                got = os.preadv(fd, batch, offset + done)
                if not got:
                    raise CheckpointError(
                        f"{_label(header, info)}: the file ends at byte {offset + done:,}, inside the tensor; it was "
                        "truncated after its header was checked: read it again once it is complete"
                    )
                done += got
                pieces = _after(pieces, got)
    except OSError as exc:
        raise CheckpointError(f"{_label(header, info)} cannot be read: {exc.strerror or exc}") from None
    if rows is not None:
        return data.reshape(stop - start, row_bytes)
    return data.reshape(*info.shape[:-1], row_bytes)
