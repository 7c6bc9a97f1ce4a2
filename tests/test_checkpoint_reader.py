"""qscheme.storage.safetensors_reader: lazy safetensors access across shards, with checked headers."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import pytest
import torch
from checkpoint_cache import (
    ct_checkpoint,
    single_threaded_torch,  # noqa: F401  (autouse)
)
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from qscheme.errors import CheckpointError
from qscheme.storage import MAX_HEADER_BYTES, SAFETENSORS_DTYPES, CheckpointFiles, read_header


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


def test_get_reads_into_memory_of_its_own() -> None:
    files = CheckpointFiles(ct_checkpoint("NVFP4"))
    name = "model.layers.0.mlp.up_proj.weight_packed"
    first, again = files.get(name), files.get(name)
    # Each call owns its memory: nothing a caller keeps points into the file.
    assert first.untyped_storage().data_ptr() != again.untyped_storage().data_ptr()
    assert torch.equal(first, load_file(str(files.folder / "model.safetensors"))[name])


def test_a_file_changed_after_its_header_was_checked_is_an_error_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(10)}, str(path))
    files = CheckpointFiles(tmp_path)
    kept = files.get("a")
    path.write_bytes(path.read_bytes()[:200])  # truncated in place: a memory map would SIGBUS here
    assert torch.equal(kept, torch.arange(1000, dtype=torch.float32))
    with pytest.raises(CheckpointError, match=r"tensor 'a' cannot be read: its size changed from \d+ to 200 bytes"):
        files.get("a")


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


@pytest.mark.parametrize(
    "shard", ["", ".", "..", "../x.safetensors", "/etc/x.safetensors", "a\x00.safetensors", "\ud800.safetensors"]
)
def test_a_shard_that_is_not_a_file_name_is_refused(tmp_path: Path, shard: str) -> None:
    # NUL and a lone surrogate can name no file: the same error as a path, not a ValueError from os.stat.
    _sharded(tmp_path, {"one.safetensors": {"a.weight": torch.zeros(2)}}, weight_map={"a.weight": shard})
    with pytest.raises(CheckpointError) as caught:
        CheckpointFiles(tmp_path)
    assert f"shard {shard!r} (for 1 tensors, e.g. 'a.weight') is not a file name" in str(caught.value)


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
            monkeypatch.setattr("qscheme.storage.safetensors_reader.os.access", lambda path, mode: False)
        with pytest.raises(CheckpointError, match=r"locked: folder is not readable"):
            CheckpointFiles(folder)
    finally:
        folder.chmod(0o755)


# ---------------------------------------------------------------------------- hostile headers


def _raw_file(path: Path, header: bytes, data: bytes = b"", length: int | None = None) -> Path:
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)
    return path


def _entry(dtype: str, shape: object, offsets: object) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


def _json(header: dict[str, object]) -> bytes:
    return json.dumps(header).encode()


U8 = _entry("U8", [1], [0, 1])
NESTED = b"[" * 130 + b"]" * 130  # safetensors stops near 128 levels; qscheme at 64
HOSTILE: list[tuple[str, bytes, bytes, str]] = [
    ("gap between tensors", _json({"a": _entry("F32", [1], [0, 4]), "b": _entry("F32", [1], [8, 12])}), bytes(12),
     r"bytes 4-8 of the data section, after tensor 'a', belong to no tensor"),
    ("gap before the first tensor", _json({"a": _entry("F32", [1], [4, 8])}), bytes(8),
     r"bytes 0-4 of the data section, at its start, belong to no tensor"),
    ("trailing bytes", _json({"a": _entry("F32", [1], [0, 4])}), bytes(8),
     r"the last tensor, 'a', ends at byte 4 of the data section but the file has 4 more bytes after it"),
    ("overlapping tensors", _json({"a": _entry("F32", [2], [0, 8]), "b": _entry("F32", [1], [4, 8])}), bytes(8),
     r"tensors 'a' and 'b' overlap in the data section"),
    ("duplicate tensor name", b'{"a":' + _json(U8) + b',"a":' + _json(U8) + b"}", bytes(1),
     r"key 'a' appears more than once"),
    ("duplicate field", b'{"a":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}}', bytes(1),
     r"key 'dtype' appears more than once"),
    ("boolean in shape", _json({"a": _entry("F32", [True], [0, 4])}), bytes(4),
     r"tensor 'a': shape \[True\] is not a list of sizes"),
    ("booleans as offsets", _json({"a": _entry("U8", [1], [False, True])}), bytes(1),
     r"tensor 'a': data_offsets \[False, True\] is not \[begin, end\]"),
    ("decimal size", _json({"a": _entry("F32", [1.0], [0, 4])}), bytes(4), r"shape \[1.0\] is not a list of sizes"),
    ("negative size", _json({"a": _entry("U8", [-1], [0, 1])}), bytes(1), r"shape \[-1\] is not a list of sizes"),
    ("size of 2**64", _json({"a": _entry("U8", [2**64], [0, 1])}), bytes(1), r"is not a list of sizes"),
    ("sizes overflowing 2**64 bits", _json({"a": _entry("F32", [2**61], [0, 1])}), bytes(1),
     r"F32 x \[2305843009213693952\] is more than 2\*\*64 bits"),
    ("integer too long to parse", b'{"a":{"dtype":"U8","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,1]}}',
     bytes(1), r"not valid JSON: an integer of 5000 digits"),
    ("NaN as a size", b'{"a":{"dtype":"U8","shape":[NaN],"data_offsets":[0,1]}}', bytes(1), r"NaN is not JSON"),
    ("4-bit tensor ending mid-byte", _json({"a": _entry("F4", [3], [0, 2])}), bytes(2),
     r"tensor 'a': F4 x \[3\] is 3 values of 4 bits, which does not end on a byte \(12 bits\); a 4-bit tensor "
     r"needs a multiple of 2 values"),
    ("4-bit scalar", _json({"a": _entry("F4", [], [0, 1])}), bytes(1), r"F4 x \[\] is 1 values of 4 bits"),
    ("metadata value not text", _json({"__metadata__": {"format": 1}, "a": U8}), bytes(1),
     r"__metadata__\['format'\] is a number \(1\); safetensors allows only text values"),
    ("metadata a list", _json({"__metadata__": ["pt"], "a": U8}), bytes(1),
     r"__metadata__ is a list; safetensors allows only an object of text keys -> text values"),
    ("metadata nested", _json({"__metadata__": {"x": {"y": "z"}}, "a": U8}), bytes(1),
     r"__metadata__\['x'\] is a object"),
    ("deeply nested field", b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":' + NESTED + b"}}", bytes(1),
     r"tensor 'a': JSON nested more than 64 levels deep"),
    ("nesting too deep to parse", b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", b"",
     r"nests JSON too deep to parse"),
    ("lone surrogate in a name", b'{"\\ud800":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}', b"",
     r"a tensor name: text '\\ud800' holds a lone UTF-16 surrogate"),
    ("unknown dtype", _json({"a": _entry("E8M0", [1], [0, 1])}), bytes(1),
     r"tensor 'a': unknown dtype 'E8M0'; safetensors writes BOOL, F4, F6_E2M3, .*F8_E8M0, F8_E4M3FNUZ, "
     r"F8_E5M2FNUZ, .*C64"),
    ("not UTF-8", b'{"\xff":1}', b"", r"the safetensors header is not UTF-8 text"),
    # safetensors multiplies the sizes in order and refuses an overflow that a later 0 would undo
    ("sizes overflowing before a 0", _json({"a": _entry("U8", [2**32, 2**32, 0], [0, 0])}), b"",
     r"tensor 'a': shape \[4294967296, 4294967296, 0\]: the product of its sizes, taken in order, passes 2\*\*64-1"),
    ("sizes overflowing before a 0, in bytes", _json({"a": _entry("F32", [2**62, 4, 0], [0, 0])}), b"",
     r"the product of its sizes, taken in order, passes"),
    ("-0 as an offset", b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[-0,1]}}', bytes(1),
     r"tensor 'a': data_offsets \[-0.0, 1\] is not \[begin, end\].*\(-0 and decimals are not integers\)"),
    ("-0 as a size", b'{"a":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}}', b"",
     r"tensor 'a': shape \[-0.0\] is not a list of sizes .*-0 are not sizes"),
    ("a number out of range in an unknown field", b'{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":1e999}}',
     b"", r"not valid JSON: the number '1e999' is out of range of a 64-bit float"),
    ("a negative number out of range", b'{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":[-2E+400]}}',
     b"", r"the number '-2E\+400' is out of range"),
    ("a number out of range in metadata", b'{"__metadata__":{"a":1e999},"b":{"dtype":"U8","shape":[0],'
     b'"data_offsets":[0,0]}}', b"", r"the number '1e999' is out of range"),
    ("not an object", b"[]", b"", r"the safetensors header is a JSON list, not an object"),
]  # fmt: skip


@pytest.mark.parametrize(("label", "header", "data", "error"), HOSTILE, ids=[case[0] for case in HOSTILE])
def test_a_hostile_header_is_refused_as_safetensors_refuses_it(
    tmp_path: Path, label: str, header: bytes, data: bytes, error: str
) -> None:
    path = _raw_file(tmp_path / "model.safetensors", header, data)
    with pytest.raises(CheckpointError) as caught:
        read_header(path)
    assert str(caught.value).startswith(f"{path}: "), str(caught.value)
    assert re.search(error, str(caught.value)), str(caught.value)
    # qscheme refuses what the safetensors reader refuses (duplicate tensor names: it keeps one silently).
    if label != "duplicate tensor name":
        with pytest.raises(SafetensorError), safe_open(str(path), "pt") as handle:
            [handle.get_tensor(name) for name in handle.keys()]


def test_the_header_length_cap_is_the_one_safetensors_enforces(tmp_path: Path) -> None:
    # No 100 MB header is written: the length field alone decides, before anything is allocated.
    over = _raw_file(tmp_path / "over.safetensors", b"{}", length=MAX_HEADER_BYTES + 1)
    with pytest.raises(CheckpointError, match=r"header length field says 100,000,001 bytes, more than the 100,000,000"):
        read_header(over)
    with pytest.raises(SafetensorError, match="header too large"):
        safe_open(str(over), "pt")
    at_cap = _raw_file(tmp_path / "at.safetensors", b"{}", length=MAX_HEADER_BYTES)
    with pytest.raises(SafetensorError, match="invalid header length"):  # the cap itself passes, the file is short
        safe_open(str(at_cap), "pt")
    with pytest.raises(CheckpointError, match=r"header length field says 100000000 bytes but the file has 2"):
        read_header(at_cap)


def test_the_dtype_codes_are_the_ones_safetensors_knows(tmp_path: Path) -> None:
    path = _raw_file(tmp_path / "x.safetensors", _json({"a": _entry("NOPE", [1], [0, 1])}), bytes(1))
    with pytest.raises(SafetensorError) as caught:
        safe_open(str(path), "pt")
    listed = re.findall(r"`([A-Z0-9_]+)`", str(caught.value).split("expected one of", 1)[1])
    assert listed == list(SAFETENSORS_DTYPES)


@pytest.mark.parametrize(
    ("code", "shape", "data"),
    [
        ("F8_E8M0", [4], bytes([127, 128, 1, 254])),
        ("C64", [2], struct.pack("<4f", 1.0, -2.0, 0.5, 3.0)),
        ("F8_E4M3FNUZ", [3], bytes([0x40, 0x38, 0x01])),
        ("F8_E5M2FNUZ", [3], bytes([0x40, 0x3C, 0x01])),
        ("F4", [2, 4], bytes([0x21, 0x43, 0x65, 0x87])),
        ("F32", [], struct.pack("<f", 2.5)),
        ("BF16", [0, 3], b""),
    ],
)
def test_each_dtype_safetensors_writes_reads_as_safetensors_reads_it(
    tmp_path: Path, code: str, shape: list[int], data: bytes
) -> None:
    header = {"__metadata__": {"format": "pt"}, "t": _entry(code, shape, [0, len(data)])}
    _raw_file(tmp_path / "model.safetensors", _json(header), data)
    ours = CheckpointFiles(tmp_path).get("t")
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as handle:
        theirs = handle.get_tensor("t")
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    assert torch.equal(ours.reshape(-1).view(torch.uint8), theirs.reshape(-1).view(torch.uint8))


def test_a_dtype_torch_cannot_hold_names_the_tensor_file_and_readable_codes(tmp_path: Path) -> None:
    path = _raw_file(tmp_path / "model.safetensors", _json({"w": _entry("F6_E2M3", [4], [0, 3])}), bytes(3))
    with pytest.raises(CheckpointError) as caught:
        CheckpointFiles(tmp_path)
    message = str(caught.value)
    assert message.startswith(f"{path}: tensor 'w': dtype F6_E2M3 has no torch dtype")
    assert "readable: BOOL, F4, U8" in message and "F6_E3M2" not in message.split("readable:")[1]


def test_accepted_oddities_agree_with_safetensors(tmp_path: Path) -> None:
    # Zero-size tensors sharing an offset, null metadata, an unknown field and header padding
    # are all valid safetensors: refusing them would refuse checkpoints other tools load.
    header = {
        "__metadata__": None,
        "empty": _entry("F16", [0], [0, 0]),
        "also_empty": _entry("I8", [2, 0], [0, 0]),
        "x": {**_entry("U8", [2], [0, 2]), "note": {"any": ["json", 1]}},
    }
    path = _raw_file(tmp_path / "model.safetensors", _json(header) + b"   ", b"\x07\x09")
    tensors = read_header(path)
    assert sorted(tensors) == ["also_empty", "empty", "x"]
    assert CheckpointFiles(tmp_path).get("x").tolist() == [7, 9]
    with safe_open(str(path), "pt") as handle:
        assert sorted(handle.keys()) == sorted(tensors)


@pytest.mark.parametrize(
    ("shape", "error"),
    [
        ([0, 2**63, 2**63], r"shape \[0, 9223372036854775808, 9223372036854775808\] has size 9223372036854775808, more "
         r"than torch's largest dimension 2\*\*63-1"),
        ([2**64 - 1, 0], r"shape \[18446744073709551615, 0\] has size 18446744073709551615, more than torch's "
         r"largest dimension"),
        ([0, 2**63 - 1, 2], r"torch cannot hold an empty tensor of shape \[0, 9223372036854775807, 2\]"),
        ([0, 2**32, 2**31], r"torch cannot hold an empty tensor of shape"),
    ],
)  # fmt: skip
def test_an_empty_shape_torch_cannot_hold_is_refused(tmp_path: Path, shape: list[int], error: str) -> None:
    path = _raw_file(tmp_path / "model.safetensors", _json({"a": _entry("F32", shape, [0, 0])}))
    with pytest.raises(CheckpointError) as caught:
        CheckpointFiles(tmp_path)
    assert re.search(rf"^{re.escape(str(path))}: tensor 'a': {error}.*: re-save", str(caught.value)), str(caught.value)
    # safetensors' header check passes it; torch then fails, untyped, where safetensors builds the tensor
    with safe_open(str(path), "pt") as handle, pytest.raises((TypeError, RuntimeError)):
        handle.get_tensor("a")


@pytest.mark.parametrize(
    "shape",
    [[0, 2**63 - 1], [2**63 - 1, 0], [2**62, 2, 0], [0, 2**62, 4], [2**32, 0, 2**32], [2, 0, 2**62], [0, 2**62, 2]],
)
@pytest.mark.parametrize("code", ["F32", "F4", "U8"])
def test_an_empty_shape_is_read_as_safetensors_and_torch_read_it(tmp_path: Path, shape: list[int], code: str) -> None:
    path = _raw_file(tmp_path / "model.safetensors", _json({"a": _entry(code, shape, [0, 0])}))
    try:
        with safe_open(str(path), "pt") as handle:
            theirs = handle.get_tensor("a")
    except (SafetensorError, TypeError, RuntimeError):
        with pytest.raises(CheckpointError, match=r"tensor 'a': "):
            CheckpointFiles(tmp_path)
        return
    ours = CheckpointFiles(tmp_path).get("a")
    assert (ours.shape, ours.dtype, ours.numel()) == (theirs.shape, theirs.dtype, 0)
