"""The checkpoint being read: an unquantized (or any) Hugging Face safetensors folder, or one file.

``SourceCheckpoint.open(path)`` checks everything before a tensor is read: a folder goes through
``qscheme.storage.CheckpointFiles`` (index against shards, hostile headers refused),
a single ``.safetensors`` file through the same header checks. It then lists:

- the shards, in the index's (sorted) order, each with its tensors in file order;
- the other files to copy through unchanged (tokenizer, generation config, chat template, ...):
  every file and folder of the checkpoint folder except the safetensors files, the index,
  ``config.json`` (rewritten with the new ``quantization_config``) and ``hf_quant_config.json``
  (a ModelOpt config that would describe other tensors); hidden entries (``.name``) are left out;
- ``config.json``'s contents ({} when there is none).

Tensors are read one at a time into memory of their own (a plain ``readinto`` at the header's
offsets); a file changed since its header was checked is a CheckpointError, never wrong data.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from qscheme.checkpoint.config import CONFIG_FILE, CONFIG_FILES
from qscheme.errors import CheckpointError, CheckpointNotFoundError
from qscheme.storage import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointFiles,
    FileHeader,
    TensorInfo,
    config_file_present,
    read_checked_tensor,
    read_file_header,
    read_json,
)


@dataclass(frozen=True)
class SourceShard:
    """One safetensors file of the source: its path, checked header and tensors in file order."""

    path: Path
    header: FileHeader
    tensors: Mapping[str, TensorInfo]

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def size(self) -> int:
        return self.header.size


class SourceCheckpoint:
    """A checkpoint to read from; see the module docstring."""

    def __init__(
        self, path: Path, folder: Path | None, shards: list[SourceShard], config: dict[str, Any], sharded: bool
    ) -> None:
        self.path = path
        self.folder = folder
        self.shards = shards
        self.config = config
        self.sharded = sharded
        self.tensors: dict[str, TensorInfo] = {}
        self._headers: dict[Path, FileHeader] = {}
        for shard in shards:
            self.tensors.update(shard.tensors)
            self._headers[shard.path] = shard.header

    @classmethod
    def open(cls, path: str | Path) -> SourceCheckpoint:
        """Check and list a checkpoint folder or a single ``.safetensors`` file."""
        path = Path(path)
        if not os.path.exists(path):
            raise CheckpointNotFoundError(f"{path}: does not exist; pass a checkpoint folder or a .safetensors file")
        if path.is_file():
            if path.suffix != ".safetensors":
                raise CheckpointError(f"{path}: is a file but not a .safetensors file; pass a checkpoint folder")
            header = read_file_header(path)
            return cls(path, None, [SourceShard(path, header, _in_file_order(header))], {}, sharded=False)
        files = CheckpointFiles(path)
        shards = []
        for file in files.files:
            header = read_file_header(file)
            shards.append(SourceShard(file, header, _in_file_order(header)))
        config_path = path / CONFIG_FILE
        config: dict[str, Any] = {}
        if config_file_present(config_path):
            value = read_json(config_path)
            if not isinstance(value, dict):
                raise CheckpointError(f"{config_path}: expected a JSON object at the top level")
            config = value
        return cls(path, path, shards, config, sharded=files.index_file is not None)

    # ------------------------------------------------------------------ what is there

    @property
    def total_bytes(self) -> int:
        return sum(shard.size for shard in self.shards)

    @property
    def largest_shard_bytes(self) -> int:
        return max((shard.size for shard in self.shards), default=0)

    @property
    def largest_tensor_bytes(self) -> int:
        return max((info.nbytes for info in self.tensors.values()), default=0)

    def output_shard_name(self, shard: SourceShard) -> str:
        """The file name the shard's output gets: the same name (a lone file becomes model.safetensors)."""
        return shard.name if self.sharded else SINGLE_FILE

    def other_files(self) -> list[Path]:
        """Files and folders to copy through unchanged, sorted (see the module docstring)."""
        if self.folder is None:
            return []
        skipped = {*CONFIG_FILES, INDEX_FILE}
        out = []
        for entry in sorted(self.folder.iterdir()):
            if entry.name.startswith(".") or entry.name in skipped or entry.name.endswith(".safetensors"):
                continue
            out.append(entry)
        return out

    def iter_shards(self) -> Iterator[SourceShard]:
        return iter(self.shards)

    # ------------------------------------------------------------------ reading

    def read(self, name: str) -> Tensor:
        """One tensor, read into memory of its own; CheckpointError naming the file on failure."""
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.path}: no tensor named {name!r}")
        return read_checked_tensor(info, self._headers[info.file])


def _in_file_order(header: FileHeader) -> dict[str, TensorInfo]:
    return dict(sorted(header.tensors.items(), key=lambda item: (item[1].offset, item[0])))
