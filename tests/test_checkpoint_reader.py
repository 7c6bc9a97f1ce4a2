"""qscheme.checkpoint.reader: lazy safetensors access across shards, with checked headers."""

from __future__ import annotations

import json
import os
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


# ---------------------------------------------------------------------------- what the folder holds


def _sharded(
    folder: Path, shards: dict[str, dict[str, torch.Tensor]], weight_map: dict[str, str] | None = None
) -> Path:
    folder.mkdir(exist_ok=True)
    for shard, tensors in shards.items():
        save_file(tensors, str(folder / shard))
    if weight_map is None:
        weight_map = {name: shard for shard, tensors in shards.items() for name in tensors}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


TWO_SHARDS = {
    "model-00001-of-00002.safetensors": {"a.weight": torch.zeros(2)},
    "model-00002-of-00002.safetensors": {"b.weight": torch.zeros(2)},
}


def test_an_empty_weight_map_is_refused(tmp_path: Path) -> None:
    _sharded(tmp_path, TWO_SHARDS, weight_map={})
    with pytest.raises(CheckpointError, match=r"index.json: weight_map is empty, so no tensor would be read"):
        CheckpointFiles(tmp_path)


def test_a_shard_the_index_never_mentions_is_refused(tmp_path: Path) -> None:
    _sharded(tmp_path, TWO_SHARDS, weight_map={"a.weight": "model-00001-of-00002.safetensors"})
    with pytest.raises(
        CheckpointError, match=r"shard file model-00002-of-00002.safetensors is in the folder but the index never"
    ):
        CheckpointFiles(tmp_path)


def test_another_safetensors_file_next_to_the_index_is_noted_not_read(tmp_path: Path) -> None:
    _sharded(tmp_path, TWO_SHARDS)
    save_file({"x": torch.zeros(1)}, str(tmp_path / "reference.safetensors"))
    files = CheckpointFiles(tmp_path)
    assert "x" not in files
    assert files.notes == ["reference.safetensors is not mentioned by model.safetensors.index.json; it is not read"]


def test_an_index_next_to_model_safetensors_is_ambiguous(tmp_path: Path) -> None:
    _sharded(tmp_path, TWO_SHARDS)
    save_file({"a.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"has both model.safetensors.index.json \(shards\) and model.safetensors"
    ):
        CheckpointFiles(tmp_path)


def test_a_missing_shard_is_reported_as_missing_before_headers_are_compared(tmp_path: Path) -> None:
    # Shard 2 holds a.weight too, but the index maps it to shard 3, which does not exist:
    # comparing shard 2's header first would blame the mapping instead of the missing file.
    weight_map = {"a.weight": "model-00003-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}
    _sharded(tmp_path, TWO_SHARDS, weight_map=weight_map)
    (tmp_path / "model-00001-of-00002.safetensors").unlink()
    save_file(
        {"a.weight": torch.zeros(2), "b.weight": torch.zeros(2)}, str(tmp_path / "model-00002-of-00002.safetensors")
    )
    with pytest.raises(
        CheckpointError,
        match=r"names shard 'model-00003-of-00002.safetensors' .* but .*00003-of-00002.safetensors does",
    ):
        CheckpointFiles(tmp_path)


@pytest.mark.parametrize("shard", ["", ".", "..", "../x.safetensors"])
def test_a_shard_that_is_not_a_file_name_is_refused(tmp_path: Path, shard: str) -> None:
    _sharded(tmp_path, {"one.safetensors": {"a.weight": torch.zeros(2)}}, weight_map={"a.weight": shard})
    with pytest.raises(
        CheckpointError, match=rf"shard {shard!r} \(for 1 tensors, e.g. 'a.weight'\) is not a file name"
    ):
        CheckpointFiles(tmp_path)


def test_a_shard_that_is_a_folder_is_reported_as_such(tmp_path: Path) -> None:
    _sharded(tmp_path, {"one.safetensors": {"a.weight": torch.zeros(2)}}, weight_map={"a.weight": "two.safetensors"})
    (tmp_path / "two.safetensors").mkdir()
    with pytest.raises(CheckpointError, match=r"names shard 'two.safetensors' .* is a folder, not a file"):
        CheckpointFiles(tmp_path)


@pytest.mark.parametrize(
    ("kind", "said"),
    [("folder", "is a folder"), ("broken link", "is a broken symbolic link"), ("fifo", "is a FIFO")],
)
def test_model_safetensors_that_is_not_a_regular_file_is_named(tmp_path: Path, kind: str, said: str) -> None:
    path = tmp_path / "model.safetensors"
    if kind == "folder":
        path.mkdir()
    elif kind == "broken link":
        path.symlink_to(tmp_path / "gone.safetensors")
    else:
        os.mkfifo(path)
    with pytest.raises(CheckpointError) as caught:
        CheckpointFiles(tmp_path)
    assert str(caught.value).startswith(f"{path}: {said}")


def test_an_unreadable_folder_is_a_checkpoint_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0)
    try:
        if os.access(folder, os.R_OK | os.X_OK):  # root with CAP_DAC_OVERRIDE reads every folder
            monkeypatch.setattr("qscheme.checkpoint.reader.os.access", lambda path, mode: False)
        with pytest.raises(CheckpointError, match=r"locked: folder is not readable"):
            CheckpointFiles(folder)
    finally:
        folder.chmod(0o755)
