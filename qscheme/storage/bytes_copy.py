"""Bytes that do not change, passed from a source shard to an output shard without torch.

Most of a converted checkpoint is bytes copied as they are: unquantized tensors (embeddings,
``lm_head``, norms) and the codes of every quantized layer. Reading them into tensors and
writing those out again costs two copies and a Python-level pass each. Instead:

- a ``RawSpan`` names a tensor's bytes in a source file (path, offset, size) with the dtype code
  and shape to write it under; ``write_shard`` appends it with ``copy_span``
  (``os.copy_file_range``: the kernel copies page cache to page cache, as ``shutil.copyfile``
  does, with no pass in Python);
- ``verify`` then checks such a tensor by re-reading it from the output and comparing it byte
  for byte with the source range (``first_difference``: both mapped, compared by numpy chunk by
  chunk), a stronger check than a CRC-32 and cheaper than taking one of the source and another
  of the output. (Writing from a mapping of the source with a CRC taken on the way, then a CRC
  pass over the output, measured twice as slow on two cores sharing memory bandwidth.)
- ``MappedShard`` maps a source shard once, for the few computations that look at codes (the
  per-layer deviation report): ``tensor(name)`` views the mapping with no copy.

The mapping is private (copy on write): nothing done through it can reach the source file. It
is opened only while the file still has the size, device, inode and modification time its
header was checked with (a CheckpointError otherwise); a file truncated while it is mapped
cannot be read safely by any mmap reader, which is why the check is made at the last moment.
"""

from __future__ import annotations

import errno
import mmap
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy
import torch
from torch import Tensor

from qscheme.errors import CheckpointError
from qscheme.storage.safetensors_header import DTYPE_BY_TORCH_NAME, FileHeader, TensorInfo
from qscheme.text import shown_file


@dataclass(frozen=True)
class RawSpan:
    """Bytes of a source file to write as one tensor, under a safetensors dtype code and shape."""

    path: Path
    offset: int  # from the start of the file
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


def copy_span(span: RawSpan, source: int, destination: int) -> None:
    """Append ``span`` (read from the open file ``source``) to the open file ``destination``:
    ``os.copy_file_range`` (the kernel copies from the page cache, as ``shutil.copyfile`` does),
    else ``pread``/``write`` in chunks where the file systems do not support it. OSError on failure."""
    done = 0
    kernel_copy = getattr(os, "copy_file_range", None)  # Linux only
    while kernel_copy is not None and done < span.nbytes:
        try:
            count = kernel_copy(source, destination, span.nbytes - done, span.offset + done)
        except OSError as exc:
            if exc.errno not in _NO_COPY_RANGE:
                raise
            break
        if count == 0:
            raise OSError(errno.EIO, f"{span.path} ends inside the bytes being copied")
        done += count
    while done < span.nbytes:
        chunk = os.pread(source, min(CHUNK, span.nbytes - done), span.offset + done)
        if not chunk:
            raise OSError(errno.EIO, f"{span.path} ends inside the bytes being copied")
        view = memoryview(chunk)
        while view.nbytes:
            view = view[os.write(destination, view) :]
        done += len(chunk)


def first_difference(a: Path, a_offset: int, b: Path, b_offset: int, nbytes: int) -> int | None:
    """The first byte at which two files' ranges differ (relative to the range), or None when
    they are equal. Both are mapped read-only and compared chunk by chunk (numpy); each chunk's
    pages are dropped from this process once compared, so the comparison adds little to its RSS.
    OSError when a file is shorter than its range."""
    if nbytes == 0:
        return None
    with open(a, "rb") as file_a, open(b, "rb") as file_b:
        map_a = _map(file_a.fileno(), a_offset, nbytes, a)
        try:
            map_b = _map(file_b.fileno(), b_offset, nbytes, b)
        except OSError:
            map_a.close()
            raise
    try:
        granularity = mmap.ALLOCATIONGRANULARITY
        return _compare(map_a, a_offset % granularity, map_b, b_offset % granularity, nbytes)
    finally:  # _compare's views are gone: the mappings close
        map_a.close()
        map_b.close()


def _compare(map_a: mmap.mmap, skip_a: int, map_b: mmap.mmap, skip_b: int, nbytes: int) -> int | None:
    view_a = numpy.frombuffer(map_a, dtype=numpy.uint8, count=nbytes, offset=skip_a)
    view_b = numpy.frombuffer(map_b, dtype=numpy.uint8, count=nbytes, offset=skip_b)
    for begin in range(0, nbytes, CHUNK):
        end = min(nbytes, begin + CHUNK)
        part_a, part_b = view_a[begin:end], view_b[begin:end]
        if not numpy.array_equal(part_a, part_b):
            return begin + int(numpy.flatnonzero(part_a != part_b)[0])
        drop_pages(map_a, skip_a + begin, skip_a + end)
        drop_pages(map_b, skip_b + begin, skip_b + end)
    return None


_NO_COPY_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF}
CHUNK = 1 << 22
_PAGE = mmap.PAGESIZE


def _map(descriptor: int, offset: int, nbytes: int, path: Path) -> mmap.mmap:
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    try:
        return mmap.mmap(descriptor, offset + nbytes - start, access=mmap.ACCESS_READ, offset=start)
    except ValueError:  # the file is shorter than the range
        raise OSError(errno.EIO, f"{path} ends inside the range being read") from None


def drop_pages(mapping: mmap.mmap, begin: int, end: int) -> None:
    """Drop the whole pages inside [begin, end) of a read-only file mapping from this process
    (they stay in the page cache)."""
    start = -(-begin // _PAGE) * _PAGE
    stop = min(end, len(mapping)) // _PAGE * _PAGE
    if stop > start and hasattr(mapping, "madvise"):
        mapping.madvise(mmap.MADV_DONTNEED, start, stop - start)


class MappedShard:
    """A checked source shard, memory-mapped privately (see the module docstring)."""

    def __init__(self, path: Path, header: FileHeader) -> None:
        self.header = header
        self.path = path
        try:
            with open(path, "rb") as handle:
                stat = os.fstat(handle.fileno())
                if stat.st_size != header.size or (stat.st_dev, stat.st_ino, stat.st_mtime_ns) != header.identity:
                    raise CheckpointError(
                        f"{shown_file(path)}: the file changed since its header was checked (another program "
                        "writes the checkpoint?); run again once it is complete"
                    )
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY) if header.size else None
        except OSError as exc:
            raise CheckpointError(f"{shown_file(path)}: cannot be read: {exc.strerror}") from None
        self._view = memoryview(self._map) if self._map is not None else memoryview(b"")

    def _info(self, name: str) -> TensorInfo:
        info = self.header.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{shown_file(self.path)}: no tensor named {name!r}")
        return info

    def bytes_of(self, name: str) -> memoryview:
        """The tensor's bytes, viewing the mapping."""
        info = self._info(name)
        return self._view[info.offset : info.offset + info.nbytes]

    def span(self, name: str, dtype: str | None = None, shape: tuple[int, ...] | None = None) -> RawSpan:
        """The tensor's bytes to write unchanged, under its own dtype code and shape unless given."""
        info = self._info(name)
        code = DTYPE_BY_TORCH_NAME[info.dtype].code if dtype is None else dtype
        return RawSpan(self.path, info.offset, info.nbytes, code, tuple(info.shape) if shape is None else shape)

    def tensor(self, name: str) -> Tensor:
        """The tensor viewing the mapping (no copy; writes to it stay private to this process)."""
        info = self._info(name)
        found = DTYPE_BY_TORCH_NAME[info.dtype]
        assert found.torch_dtype is not None  # read_file_header refuses dtypes torch lacks
        shape = list(info.shape)
        if found.bits == 4:
            shape[-1] //= 2
        if info.nbytes == 0:
            return torch.empty(shape, dtype=found.torch_dtype)
        with warnings.catch_warnings():  # the private mapping is writable; torch warns for read-only buffers only
            warnings.simplefilter("ignore")
            data = torch.frombuffer(self.bytes_of(name), dtype=torch.uint8)
        return data.view(found.torch_dtype).reshape(shape)

    def close(self) -> None:
        """Drop this object's references; the mapping goes when the last span or tensor viewing it does."""
        self._view = memoryview(b"")
        self._map = None
