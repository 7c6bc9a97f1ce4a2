"""verify_folder: a shard whose bytes changed after writing, or an index that disagrees, is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qscheme.errors import OutputError
from qscheme.storage import write_index, write_shard
from qscheme.writing.verify import verify_folder


def test_written_shards_read_back_and_corruption_is_caught(tmp_path: Path) -> None:
    tensors = {"a.weight": torch.randn(8, 16, dtype=torch.bfloat16), "a.weight_scale": torch.rand(8, 1)}
    record = write_shard(tmp_path / "model-00001-of-00001.safetensors", tensors)
    write_index(tmp_path, {name: record.path.name for name in tensors}, record.data_bytes)
    assert verify_folder(tmp_path, [record]) == record.data_bytes
    back = load_file(str(record.path))
    assert all(torch.equal(back[name], value) for name, value in tensors.items())
    data = bytearray(record.path.read_bytes())
    data[-1] ^= 0xFF
    record.path.write_bytes(bytes(data))
    with pytest.raises(OutputError, match=r"'a\.weight_scale' reads back with other bytes"):
        verify_folder(tmp_path, [record])


def test_an_index_that_disagrees_is_refused(tmp_path: Path) -> None:
    record = write_shard(tmp_path / "model-00001-of-00001.safetensors", {"a.weight": torch.ones(2, 2)})
    write_index(tmp_path, {"b.weight": record.path.name}, 16)
    with pytest.raises(OutputError, match="weight_map does not match"):
        verify_folder(tmp_path, [record])
