"""A GGUF file seen as the loader sees a checkpoint folder: tensors by transformers name.

``GGUFFiles`` is a ``CheckpointFiles`` whose tensors are placed GGUF tensors (``Placed``): a
quantized layer's weight is its raw blocks, uint8 [N, row_bytes] (the bytes of the scheme
``gguf/<TYPE>``'s one declared tensor), its rows in transformers' order; one expert of stacked
experts is its range of rows; a plain tensor (norms, biases, unquantized weights) is its values
in the dtype they are stored in (BF16 passes through float32 for transformers' processor, which
works on numpy arrays, and comes back bit for bit). Every read goes through
``storage.read_gguf_tensor``: a plain read of the bytes it needs, the file checked unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from qscheme.checkpoint.gguf_names import GGUFNames
from qscheme.errors import CheckpointError
from qscheme.storage import CheckpointFiles, GGUFHeader, TensorInfo, read_gguf_tensor
from qscheme.text import shown, shown_file

__all__ = ["GGUFFiles", "Placed"]


@dataclass(frozen=True)
class Placed:
    """Where one transformers tensor comes from in the GGUF file.

    ``shape`` is what ``GGUFFiles.get`` returns: [N, row_bytes] for a quantized weight, the
    model's shape for a plain tensor. ``rows`` selects one expert's rows of a stacked tensor;
    ``row_order`` reorders a quantized weight's rows (llama's q/k); ``dtype`` is the torch dtype of
    a plain tensor (None: quantized); ``processed``: transformers' processor runs on its values."""

    name: str
    tensor: str
    ggml_type: str
    shape: tuple[int, ...]
    offset: int
    rows: slice | None = None
    row_order: torch.Tensor | None = None
    dtype: str | None = None
    processed: bool = False


class GGUFFiles(CheckpointFiles):
    """The tensors of one GGUF file by transformers name (see the module docstring)."""

    def __init__(self, header: GGUFHeader, placed: Mapping[str, Placed], names: GGUFNames, notes: list[str]) -> None:
        # Not CheckpointFiles.__init__: there is no folder to scan; the same attributes, filled here.
        self.folder = header.path
        self.index_file: Path | None = None
        self.files = [header.path]
        self.notes = list(notes)
        self._headers = {}
        self.header = header
        self.placed = dict(placed)
        self.names = names
        self.tensors = {
            name: TensorInfo(name, place.dtype or "uint8", place.shape, header.path, place.offset)
            for name, place in self.placed.items()
        }

    @property
    def total_bytes(self) -> int:
        return self.header.file_size

    def get(self, name: str) -> torch.Tensor:
        """One tensor as ``Placed`` describes it, read into memory of its own; CheckpointError
        naming the file and the GGUF tensor on failure."""
        place = self.placed.get(name)
        if place is None:
            raise CheckpointError(f"{shown_file(self.header.path)}: no tensor is placed as {shown(name)!r}")
        if place.dtype is None:  # raw blocks, their rows placed in transformers' order as they are read
            order = None if place.row_order is None else place.row_order.tolist()
            return read_gguf_tensor(self.header, place.tensor, rows=place.rows, row_order=order)
        raw = read_gguf_tensor(self.header, place.tensor, rows=place.rows)
        dtype = getattr(torch, place.dtype)
        stored = self.header.tensors[place.tensor].shape
        values = raw.view(dtype).reshape(stored[1:] if place.rows is not None else stored)
        if place.processed:
            values = self._processed(place, values)
        if tuple(values.shape) != place.shape:
            raise CheckpointError(
                f"{shown_file(self.header.path)}: tensor {shown(place.tensor)!r} ({place.ggml_type} "
                f"{list(stored)}) becomes {list(values.shape)} for {shown(name)!r}, which the model holds as "
                f"{list(place.shape)}: the file does not fit the model its header describes"
            )
        return values.contiguous()

    def _processed(self, place: Placed, values: torch.Tensor) -> torch.Tensor:
        """transformers' processor on the values (numpy has no bfloat16: those go through float32)."""
        wide = values.float() if values.dtype == torch.bfloat16 else values
        result = torch.from_numpy(self.names.processed(place.tensor, wide.numpy()).copy())
        return result.to(values.dtype)
