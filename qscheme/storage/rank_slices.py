"""Read one rank's slice of a safetensors tensor: only its bytes, counted.

A shard splits one dimension of a row-major tensor, so it is a run of contiguous bytes per
index of the dimensions before it (one run for a split of dim 0, one per row for a split of
the last dim). Each run is read with ``os.preadv`` straight into the result's memory, as
``safetensors_reader`` reads whole tensors: no memory map, so a file truncated under the
reader gives a CheckpointError rather than a SIGBUS. ``ReadCounter`` adds up what was read, per
tensor, so that a test can check each rank reads about 1/n of every split layer.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from qscheme.errors import CheckpointError
from qscheme.storage.safetensors_header import DTYPE_BY_TORCH_NAME, TensorInfo
from qscheme.storage.safetensors_reader import allocate_bytes
from qscheme.text import shown_file


@dataclass
class ReadCounter:
    """Bytes read per tensor name, and the number of contiguous runs read."""

    by_tensor: dict[str, int] = field(default_factory=dict)
    runs: int = 0

    @property
    def total(self) -> int:
        return sum(self.by_tensor.values())

    def add(self, name: str, count: int, runs: int) -> None:
        self.by_tensor[name] = self.by_tensor.get(name, 0) + count
        self.runs += runs


def _byte_shape(info: TensorInfo) -> tuple[list[int], int]:
    """(shape, bytes per element) with 4-bit tensors seen as bytes along their last dim."""
    bits = DTYPE_BY_TORCH_NAME[info.dtype].bits
    shape = list(info.shape)
    if bits == 4:
        shape[-1] //= 2
        return shape, 1
    return shape, bits // 8


def _byte_index(info: TensorInfo, index: Sequence[slice]) -> list[slice]:
    """``index`` in the units of ``_byte_shape`` (halved along the last dim of a 4-bit tensor)."""
    out = [
        slice(0 if s.start is None else s.start, size if s.stop is None else s.stop)
        for s, size in zip(index, info.shape, strict=True)
    ]
    if DTYPE_BY_TORCH_NAME[info.dtype].bits == 4:
        last = out[-1]
        if last.start % 2 or last.stop % 2:
            raise CheckpointError(
                f"{shown_file(info.file)}: tensor {info.name!r}: cannot read elements {last.start}:{last.stop} of its "
                "last dimension: two 4-bit values share a byte; slice at even positions"
            )
        out[-1] = slice(last.start // 2, last.stop // 2)
    return out


def read_slice(info: TensorInfo, index: Sequence[slice], counter: ReadCounter | None = None) -> torch.Tensor:
    """The part ``index`` (one slice per dimension, at most one of them partial) of a stored tensor.

    Reads only that part's bytes; CheckpointError naming the file and tensor on a bad index or
    a file that ends early.
    """
    if len(index) != len(info.shape):
        raise CheckpointError(
            f"{shown_file(info.file)}: tensor {info.name!r} has {len(info.shape)} dimensions, the slice {len(index)}"
        )
    shape, item = _byte_shape(info)
    slices = _byte_index(info, index)
    for s, size in zip(slices, shape, strict=True):
        if not 0 <= s.start <= s.stop <= size or s.step not in (None, 1):
            raise CheckpointError(
                f"{shown_file(info.file)}: tensor {info.name!r} of shape {list(info.shape)}: slice "
                f"{s.start}:{s.stop} is outside its {size} elements"
            )
    partial = [d for d, (s, size) in enumerate(zip(slices, shape, strict=True)) if (s.start, s.stop) != (0, size)]
    if len(partial) > 1:
        raise CheckpointError(f"{info.name!r}: a shard splits one dimension; {len(partial)} were sliced")
    dim = partial[0] if partial else 0
    outer = 1
    for size in shape[:dim]:
        outer *= size
    inner = item
    for size in shape[dim + 1 :]:
        inner *= size
    start, stop = (slices[dim].start, slices[dim].stop) if shape else (0, 1)
    run = (stop - start) * inner
    stride = (shape[dim] if shape else 1) * inner
    data = allocate_bytes(info, outer * run)  # a typed error when a claimed size cannot be had
    view = data.numpy().data.cast("B")
    try:
        with info.file.open("rb", buffering=0) as handle:
            fd = handle.fileno()
            for row in range(outer if run else 0):
                offset = info.offset + row * stride + start * inner
                got = os.preadv(fd, [view[row * run : (row + 1) * run]], offset)
                if got != run:
                    raise CheckpointError(
                        f"{shown_file(info.file)}: tensor {info.name!r}: the file ends at byte {offset + got}, inside "
                        "the tensor; it was truncated after its header was checked: load it again once it is complete"
                    )
    except OSError as exc:
        raise CheckpointError(f"{shown_file(info.file)}: tensor {info.name!r} cannot be read: {exc.strerror}") from None
    if counter is not None:
        counter.add(info.name, outer * run, outer if run else 0)
    dtype = DTYPE_BY_TORCH_NAME[info.dtype].torch_dtype
    assert dtype is not None  # read_file_header refuses dtypes torch lacks
    out_shape = [s.stop - s.start for s in slices]
    if not info.shape:
        out_shape = []
    return data.view(dtype).reshape(out_shape)


def read_whole(info: TensorInfo, counter: ReadCounter | None = None) -> torch.Tensor:
    """A whole stored tensor (replicated on every rank), counted like a slice."""
    return read_slice(info, [slice(0, size) for size in info.shape], counter)
