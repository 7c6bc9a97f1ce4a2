"""qscheme.checkpoint.reader: lazy safetensors access across shards, with checked headers."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from checkpoint_cache import (
    ct_checkpoint,
    single_threaded_torch,  # noqa: F401  (autouse)
)
from safetensors.torch import load_file, save_file

from qscheme.checkpoint.reader import CheckpointFiles, read_header
from qscheme.errors import CheckpointError


def test_single_file_headers_without_reading_data() -> None:
    files = CheckpointFiles(ct_checkpoint("NVFP4"))
    info = files.info("model.layers.0.self_attn.q_proj.weight_packed")
    assert (info.dtype, info.shape) == ("uint8", (128, 64))
    assert files.files == [files.folder / "model.safetensors"]
    assert len(files) == 33


def test_sharded_checkpoint_with_index_reads_each_tensor_from_its_shard() -> None:
    folder = ct_checkpoint("W4A16", max_shard_size="100KB")
    files = CheckpointFiles(folder)
    assert files.index_file is not None and len(files.files) > 1
    single = CheckpointFiles(ct_checkpoint("W4A16"))
    assert set(files.tensors) == set(single.tensors)
    for name in ("model.layers.0.mlp.down_proj.weight_packed", "lm_head.weight"):
        assert torch.equal(files.get(name), single.get(name))
    shards = {files.info(name).file.name for name in files}
    assert len(shards) == len(files.files)


def test_get_is_memory_mapped_not_copied() -> None:
    files = CheckpointFiles(ct_checkpoint("NVFP4"))
    first = files.get("model.layers.0.mlp.up_proj.weight_packed")
    again = files.get("model.layers.0.mlp.up_proj.weight_packed")
    # Both views share the file mapping: one storage, no private copy per call.
    assert first.untyped_storage().data_ptr() == again.untyped_storage().data_ptr()


def test_tensor_in_two_shards_is_refused(tmp_path: Path) -> None:
    save_file({"a.weight": torch.zeros(2)}, str(tmp_path / "one.safetensors"))
    save_file({"a.weight": torch.zeros(2), "b.weight": torch.zeros(2)}, str(tmp_path / "two.safetensors"))
    index = {"weight_map": {"a.weight": "one.safetensors", "b.weight": "two.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"two.safetensors: tensor 'a.weight' is also in shard one.safetensors"):
        CheckpointFiles(tmp_path)


def test_missing_files_are_named(tmp_path: Path) -> None:
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(
        CheckpointError, match=r"has neither model.safetensors nor model.safetensors.index.json; found weights"
    ):
        CheckpointFiles(tmp_path)
    with pytest.raises(CheckpointError, match="not a folder"):
        CheckpointFiles(tmp_path / "nope")


def test_header_size_mismatch_names_the_tensor(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"x": torch.zeros(4), "y": torch.ones(2)}, str(path))
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    header["y"]["shape"] = [3]
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(size)
    path.write_bytes(data[:8] + raw + data[8 + size :])
    with pytest.raises(CheckpointError, match=r"tensor 'y': header says 8 bytes .* but F32 x \[3\] needs 12"):
        read_header(path)
    assert load_file  # safetensors itself is only used for data
