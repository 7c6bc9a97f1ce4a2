"""qscheme.storage's GGUF container: the type table, read_gguf_header, read_gguf_tensor, write_gguf.

Files are written three ways: by gguf-py's GGUFWriter (the reference; its tests skip when the
optional ``gguf`` package is absent), by ``write_gguf``, and byte by byte by the small encoder
below (``_file``), written from the format's description, to craft the damaged files each
check must refuse.
"""

from __future__ import annotations

import math
import os
import random
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from qscheme.errors import CheckpointError, DestinationError, UsageError
from qscheme.storage import (
    GGML_TYPES,
    ggml_type_by_name,
    read_gguf_header,
    read_gguf_tensor,
    write_gguf,
)
from qscheme.storage import gguf_header as gguf_header_module

# ---------------------------------------------------------------------------- a byte-level encoder

U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_CODES = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "B", U64: "Q", I64: "q", F64: "d"}


def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _payload(type_id: int, value: Any) -> bytes:
    if type_id == STRING:
        return _s(value)
    if type_id == ARRAY:
        element, items = value
        if element == ARRAY:
            return struct.pack("<IQ", ARRAY, len(items)) + b"".join(_payload(ARRAY, item) for item in items)
        return struct.pack("<IQ", element, len(items)) + b"".join(_payload(element, item) for item in items)
    return struct.pack("<" + _CODES[type_id], value)


def _kv(key: str | bytes, type_id: int, value: Any) -> bytes:
    return _s(key) + struct.pack("<I", type_id) + _payload(type_id, value)


def _info(name: str | bytes, dims: list[int], type_id: int, offset: int) -> bytes:
    return _s(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, type_id, offset)


def _file(
    kvs: list[bytes],
    infos: list[bytes],
    data: bytes = b"",
    *,
    version: int = 3,
    alignment: int = 32,
    counts: tuple[int, int] | None = None,
) -> bytes:
    tensor_count, kv_count = counts if counts is not None else (len(infos), len(kvs))
    header = b"GGUF" + struct.pack("<IQQ", version, tensor_count, kv_count) + b"".join(kvs) + b"".join(infos)
    return header + bytes(-len(header) % alignment) + data


def _write(tmp_path: Path, raw: bytes, name: str = "model.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(raw)
    return path


def _refused(path: Path, *fragments: str) -> str:
    with pytest.raises(CheckpointError) as caught:
        read_gguf_header(path)
    message = str(caught.value)
    assert str(path.name) in message and "at byte" in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


# A valid two-tensor file: an F32 [2, 4] and a Q8_0 [2, 32] (34 bytes a row).
F32_DATA = struct.pack("<8f", *range(8))
Q8_DATA = bytes(range(68))


def _valid(**kwargs: Any) -> bytes:
    infos = [_info("a", [4, 2], 0, 0), _info("b", [32, 2], 8, 32)]
    data = F32_DATA + bytes(32 - len(F32_DATA)) + Q8_DATA + bytes(-len(Q8_DATA) % 32)
    return _file([_kv("general.architecture", STRING, "llama")], infos, data, **kwargs)


# ---------------------------------------------------------------------------- the type table


def test_type_table_equals_gguf_constants() -> None:
    constants = pytest.importorskip("gguf.constants")
    known = {int(t): t for t in constants.GGMLQuantizationType}
    for type_id, member in known.items():
        blocks = constants.GGML_QUANT_SIZES[member]
        assert GGML_TYPES[type_id].name == member.name
        assert (GGML_TYPES[type_id].block_elements, GGML_TYPES[type_id].block_bytes) == blocks
    assert set(GGML_TYPES) == set(known)


def test_type_by_name() -> None:
    assert ggml_type_by_name("Q4_K").id == 12
    with pytest.raises(UsageError, match=r"'Q9_9'.*Q4_0.*NVFP4"):
        ggml_type_by_name("Q9_9")


# ---------------------------------------------------------------------------- reading crafted files


def test_reads_a_crafted_file(tmp_path: Path) -> None:
    header = read_gguf_header(_write(tmp_path, _valid()))
    assert header.version == 3 and header.alignment == 32
    assert header.metadata == {"general.architecture": "llama"}
    assert list(header.tensors) == ["a", "b"]
    a, b = header.tensors["a"], header.tensors["b"]
    assert (a.type.name, a.dims, a.shape, a.rows, a.row_bytes, a.nbytes) == ("F32", (4, 2), (2, 4), 2, 16, 32)
    assert (b.type.name, b.shape, b.row_bytes, b.nbytes) == ("Q8_0", (2, 32), 34, 68)
    assert header.data_offset % 32 == 0 and b.offset == header.data_offset + 32
    assert read_gguf_tensor(header, "a").view(torch.float32).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert bytes(read_gguf_tensor(header, "b").flatten().tolist()) == Q8_DATA
    assert read_gguf_tensor(header, "b").shape == (2, 34)


def test_version_2_reads_as_version_3(tmp_path: Path) -> None:
    three = read_gguf_header(_write(tmp_path, _valid(), "v3.gguf"))
    two = read_gguf_header(_write(tmp_path, _valid(version=2), "v2.gguf"))
    assert two.version == 2
    assert two.tensors == {n: t for n, t in three.tensors.items()} and two.metadata == three.metadata


EVERY_VALUE = [
    ("u8", U8, 255, "UINT8"),
    ("i8", I8, -128, "INT8"),
    ("u16", U16, 65535, "UINT16"),
    ("i16", I16, -32768, "INT16"),
    ("u32", U32, 2**32 - 1, "UINT32"),
    ("i32", I32, -(2**31), "INT32"),
    ("f32", F32, 0.25, "FLOAT32"),
    ("bool", BOOL, 1, "BOOL"),
    ("str", STRING, "héllo ✓", "STRING"),
    ("u64", U64, 2**64 - 1, "UINT64"),
    ("i64", I64, -(2**63), "INT64"),
    ("f64", F64, math.pi, "FLOAT64"),
    ("floats", ARRAY, (F32, [0.5, -2.0]), "ARRAY[FLOAT32]"),
    ("bools", ARRAY, (BOOL, [0, 1, 1]), "ARRAY[BOOL]"),
    ("strings", ARRAY, (STRING, ["a", "", "ü"]), "ARRAY[STRING]"),
    ("nested", ARRAY, (ARRAY, [(I32, [1, 2]), (I32, [])]), "ARRAY[ARRAY[INT32]]"),
    ("mixed", ARRAY, (ARRAY, [(I32, [1]), (STRING, ["x"])]), "ARRAY[ARRAY]"),
    ("deep", ARRAY, (ARRAY, [(ARRAY, [(U8, [7])])]), "ARRAY[ARRAY[ARRAY[UINT8]]]"),
    ("empty", ARRAY, (U64, []), "ARRAY[UINT64]"),
]


def _python(type_id: int, value: Any) -> Any:
    if type_id == BOOL:
        return bool(value)
    if type_id == ARRAY:
        element, items = value
        return [_python(element, item) for item in items]
    return value


def test_every_value_type(tmp_path: Path) -> None:
    kvs = [_kv(key, type_id, value) for key, type_id, value, _ in EVERY_VALUE]
    header = read_gguf_header(_write(tmp_path, _file(kvs, [])))
    for key, type_id, value, kind in EVERY_VALUE:
        assert header.metadata_types[key] == kind, key
        assert header.metadata[key] == _python(type_id, value), key
        assert type(header.metadata[key]) is type(_python(type_id, value)), key
    assert header.metadata["bool"] is True and header.metadata["bools"] == [False, True, True]


def test_alignment_other_than_32(tmp_path: Path) -> None:
    infos = [_info("a", [4, 2], 0, 0), _info("b", [32, 2], 8, 64)]
    data = F32_DATA + bytes(64 - 32) + Q8_DATA
    raw = _file([_kv("general.alignment", U32, 64)], infos, data, alignment=64)
    header = read_gguf_header(_write(tmp_path, raw))
    assert header.alignment == 64 and header.data_offset % 64 == 0
    assert header.tensors["b"].offset == header.data_offset + 64
    assert bytes(read_gguf_tensor(header, "b").flatten().tolist()) == Q8_DATA


def test_three_dimensional_tensor_and_row_ranges(tmp_path: Path) -> None:
    experts = bytes(range(256)) * 4  # Q8_0 [E=3, N=4, K=64]: 2 blocks of 34 bytes a row
    experts = experts[: 3 * 4 * 68]
    header = read_gguf_header(_write(tmp_path, _file([], [_info("experts", [64, 4, 3], 8, 0)], experts)))
    info = header.tensors["experts"]
    assert (info.shape, info.rows, info.row_bytes) == ((3, 4, 64), 12, 68)
    whole = read_gguf_tensor(header, "experts")
    assert whole.shape == (3, 4, 68) and bytes(whole.flatten().tolist()) == experts
    part = read_gguf_tensor(header, "experts", slice(5, 9))
    assert part.shape == (4, 68) and bytes(part.flatten().tolist()) == experts[5 * 68 : 9 * 68]
    assert torch.equal(read_gguf_tensor(header, "experts", slice(None, 4)), whole[0])
    assert read_gguf_tensor(header, "experts", slice(12, 12)).shape == (0, 68)


def test_rows_read_in_a_given_order_equal_index_select(tmp_path: Path) -> None:
    data = bytes(random.Random(5).randrange(256) for _ in range(12 * 68))  # Q8_0 [N=12, K=64]
    header = read_gguf_header(_write(tmp_path, _file([], [_info("w", [64, 12], 8, 0)], data)))
    whole = read_gguf_tensor(header, "w")
    order = [11, 0, 5, 3, 1, 2, 4, 6, 10, 8, 7, 9]
    placed = read_gguf_tensor(header, "w", row_order=order)
    assert torch.equal(placed, whole.index_select(0, torch.tensor(order)))
    part = read_gguf_tensor(header, "w", slice(4, 8), row_order=[3, 2, 1, 0])
    assert torch.equal(part, whole[4:8].flip(0))
    for bad in ([0, 1], [0] * 12, list(range(1, 13))):
        with pytest.raises(UsageError, match="row_order must be a permutation of the 12 rows read"):
            read_gguf_tensor(header, "w", row_order=bad)


# ---------------------------------------------------------------------------- refusals


def test_bad_magic_and_versions(tmp_path: Path) -> None:
    _refused(_write(tmp_path, b"GGUX" + _valid()[4:]), "the magic", "b'GGUX'", "not a GGUF")
    _refused(_write(tmp_path, _valid(version=1)), "the version", "is 1", "re-convert")
    _refused(_write(tmp_path, _valid(version=4)), "the version", "is 4", "2 and 3")
    big = b"GGUF" + struct.pack(">I", 3) + _valid()[8:]
    _refused(_write(tmp_path, big), "big-endian")
    _refused(_write(tmp_path, b"GGU"), "the magic and version", "file ends at byte 3", "re-download")


@pytest.mark.parametrize("cut", [10, 30, 60, 90])
def test_a_truncated_header_is_refused(tmp_path: Path, cut: int) -> None:
    message = _refused(_write(tmp_path, _valid()[:cut]), "ends at byte")
    assert f"{cut}" in message


def test_counts_and_lengths_are_checked_before_reading(tmp_path: Path) -> None:
    huge = 2**64 - 1
    _refused(_write(tmp_path, _valid(counts=(huge, 1))), "the tensor count", "18,446,744,073,709,551,615")
    _refused(_write(tmp_path, _valid(counts=(2, 2**40))), "the metadata key count", "1,099,511,627,776")
    long_key = struct.pack("<Q", huge) + b"k"
    _refused(_write(tmp_path, _file([long_key], [])), "metadata key 0 length", "the file ends at byte")
    long_value = _s("k") + struct.pack("<IQ", STRING, 2**62)
    _refused(_write(tmp_path, _file([long_value], [])), "metadata key 'k' length", "4,611,686,018,427,387,904")
    long_array = _s("k") + struct.pack("<IIQ", ARRAY, F64, 2**61)
    _refused(_write(tmp_path, _file([long_array], [])), "metadata key 'k' count", "needs at least")
    strings = _s("k") + struct.pack("<IIQ", ARRAY, STRING, 2) + _s("x") + struct.pack("<Q", 2**50)
    _refused(_write(tmp_path, _file([strings], [])), "metadata key 'k' element 1 length", "file ends")


def test_header_longer_than_the_bound_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_header_module, "MAX_GGUF_HEADER_BYTES", 64)
    raw = _file([_kv("k", STRING, "x" * 200)], [])
    _refused(_write(tmp_path, raw), "metadata key 'k'", "longer than 64 bytes")


def test_bad_metadata_is_refused(tmp_path: Path) -> None:
    _refused(_write(tmp_path, _file([_kv(b"k\xff", U8, 1)], [])), "metadata key 0", "not UTF-8", "b'\\xff'")
    _refused(_write(tmp_path, _file([_kv("k", STRING, b"\xc3(")], [])), "metadata key 'k'", "not UTF-8")
    bad_strings = _kv("k", ARRAY, (STRING, [b"ok", b"\xe2\x28\xa1"]))
    _refused(_write(tmp_path, _file([bad_strings], [])), "metadata key 'k' element 1", "not UTF-8")
    unknown = _s("k") + struct.pack("<IB", 13, 0)
    _refused(_write(tmp_path, _file([unknown], [])), "metadata key 'k' value type", "is 13", "12 FLOAT64")
    element = _s("k") + struct.pack("<IIQ", ARRAY, 99, 0)
    _refused(_write(tmp_path, _file([element], [])), "metadata key 'k' element type", "is 99")
    _refused(_write(tmp_path, _file([_kv("k", BOOL, 2)], [])), "metadata key 'k'", "is 2", "0 or 1")
    bools = _kv("k", ARRAY, (BOOL, [1, 0, 7]))
    _refused(_write(tmp_path, _file([bools], [])), "metadata key 'k' element 2", "is 7", "0 or 1")
    twice = [_kv("k", U8, 1), _kv("k", U8, 1)]
    _refused(_write(tmp_path, _file(twice, [])), "metadata key 'k'", "appears twice")
    deep: Any = (U8, [])
    for _ in range(gguf_header_module.MAX_ARRAY_DEPTH):
        deep = (ARRAY, [deep])
    _refused(_write(tmp_path, _file([_kv("k", ARRAY, deep)], [])), "metadata key 'k'", "nests arrays more than")


def test_bad_alignment_is_refused(tmp_path: Path) -> None:
    wrong_type = _file([_kv("general.alignment", U64, 32)], [])
    _refused(_write(tmp_path, wrong_type), "metadata key 'general.alignment'", "UINT64", "must be a UINT32")
    for value in (0, 48):
        raw = _file([_kv("general.alignment", U32, value)], [])
        _refused(_write(tmp_path, raw), "metadata key 'general.alignment'", f"is {value}", "power of two")


def _one_tensor(tmp_path: Path, info: bytes, data: bytes = b"\0" * 64) -> Path:
    return _write(tmp_path, _file([], [info], data))


def test_bad_tensor_infos_are_refused(tmp_path: Path) -> None:
    _refused(_one_tensor(tmp_path, _info("x" * 64, [4], 0, 0)), "tensor 0", "64 bytes long", "at most 63")
    _refused(_one_tensor(tmp_path, _info(b"\xff", [4], 0, 0)), "tensor 0 name", "not UTF-8")
    _refused(_one_tensor(tmp_path, _info("w", [1, 1, 1, 1, 1], 0, 0)), "tensor 0 'w' n_dims", "is 5")
    _refused(_one_tensor(tmp_path, _info("w", [2**63], 0, 0)), "tensor 0 'w' dims", "2**63")
    _refused(_one_tensor(tmp_path, _info("w", [2**32, 2**32], 0, 0)), "tensor 0 'w' dims", "product")
    _refused(_one_tensor(tmp_path, _info("w", [4], 4, 0)), "tensor 0 'w' type", "is 4", "2 Q4_0")
    _refused(_one_tensor(tmp_path, _info("w", [16, 2], 2, 0)), "tensor 0 'w' dims", "16", "Q4_0's block of 32")
    twice = _file([], [_info("w", [4], 0, 0), _info("w", [4], 0, 32)], b"\0" * 64)
    _refused(_write(tmp_path, twice), "tensor 1 'w' name", "appears twice")


def test_bad_offsets_are_refused(tmp_path: Path) -> None:
    data = b"\0" * 128
    unaligned = _file([], [_info("a", [4], 0, 0), _info("b", [4], 0, 16)], data)
    _refused(_write(tmp_path, unaligned), "tensor 1 'b' offset", "is 16", "multiple of the alignment 32")
    overlap = _file([], [_info("a", [16], 0, 0), _info("b", [4], 0, 32)], data)
    _refused(_write(tmp_path, overlap), "tensor 1 'b' offset", "inside the data of an earlier tensor", "64")
    gap = _file([], [_info("a", [4], 0, 0), _info("b", [4], 0, 64)], data)
    _refused(_write(tmp_path, gap), "tensor 1 'b' offset", "after a gap", "after tensor 'a' that is 32")
    first = _file([], [_info("a", [4], 0, 32)], data)
    _refused(_write(tmp_path, first), "tensor 0 'a' offset", "is 32", "the first at 0")
    past_end = _file([], [_info("a", [4], 0, 0), _info("b", [64], 0, 32)], data[:100])
    _refused(_write(tmp_path, past_end), "tensor 1 'b' offset", "past the file's end")


def test_an_unreadable_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="cannot be read"):
        read_gguf_header(tmp_path / "missing.gguf")
    with pytest.raises(CheckpointError, match="cannot be read"):
        read_gguf_header(tmp_path)


# ---------------------------------------------------------------------------- read_gguf_tensor refusals


def test_read_tensor_refusals(tmp_path: Path) -> None:
    path = _write(tmp_path, _valid())
    header = read_gguf_header(path)
    with pytest.raises(CheckpointError, match=r"no tensor named 'c'; it holds a, b"):
        read_gguf_tensor(header, "c")
    for rows in (slice(0, 3), slice(-1, None), slice(0, 2, 2), slice(2, 1), 1):
        with pytest.raises(UsageError, match=r"tensor 'a' \(F32 x \[2, 4\]\)"):
            read_gguf_tensor(header, "a", rows)  # type: ignore[arg-type]
    path.write_bytes(path.read_bytes()[: header.tensors["b"].offset + 10])
    with pytest.raises(CheckpointError, match="size changed"):
        read_gguf_tensor(header, "b")


def test_read_tensor_notices_a_rewrite(tmp_path: Path) -> None:
    path = _write(tmp_path, _valid())
    header = read_gguf_header(path)
    path.unlink()
    _write(tmp_path, _valid())  # same size, another file
    with pytest.raises(CheckpointError, match="rewritten"):
        read_gguf_tensor(header, "a")


# ---------------------------------------------------------------------------- write_gguf


def _q8(rows: int, k: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rows * 1000 + k)
    return torch.randint(0, 256, (rows, k // 32 * 34), dtype=torch.uint8, generator=generator)


def _sample_tensors() -> list[tuple[str, Any, tuple[int, ...], torch.Tensor]]:
    return [
        ("token_embd.weight", ggml_type_by_name("F16"), (3, 8), torch.arange(24, dtype=torch.float16).reshape(3, 8)),
        ("blk.0.attn_q.weight", ggml_type_by_name("Q8_0"), (4, 64), _q8(4, 64)),
        ("blk.0.ffn_up_exps.weight", ggml_type_by_name("Q8_0"), (2, 3, 32), _q8(6, 32).reshape(2, 3, 34)),
        ("output_norm.weight", ggml_type_by_name("F32"), (8,), torch.linspace(-1, 1, 8).view(torch.uint8)),
    ]


SAMPLE_METADATA: dict[str, tuple[str, Any]] = {
    "general.architecture": ("STRING", "llama"),
    "u8": ("UINT8", 200),
    "i8": ("INT8", -5),
    "u16": ("UINT16", 60000),
    "i16": ("INT16", -30000),
    "u32": ("UINT32", 4_000_000_000),
    "i32": ("INT32", -2_000_000_000),
    "f32": ("FLOAT32", 1.5),
    "bool": ("BOOL", True),
    "u64": ("UINT64", 2**64 - 1),
    "i64": ("INT64", -(2**63)),
    "f64": ("FLOAT64", 1e300),
    "tokens": ("ARRAY[STRING]", ["<s>", "é", ""]),
    "scores": ("ARRAY[FLOAT32]", [0.0, -1.25, 3.5]),
    "flags": ("ARRAY[BOOL]", [True, False]),
    "nested": ("ARRAY[ARRAY[INT32]]", [[1, 2], [], [3]]),
}


def test_write_then_read_with_ours(tmp_path: Path) -> None:
    path = tmp_path / "out.gguf"
    write_gguf(path, SAMPLE_METADATA, _sample_tensors())
    header = read_gguf_header(path)
    assert header.version == 3 and header.alignment == 32
    assert dict(header.metadata) == {key: value for key, (_, value) in SAMPLE_METADATA.items()}
    assert dict(header.metadata_types) == {key: kind for key, (kind, _) in SAMPLE_METADATA.items()}
    for name, ggml_type, shape, data in _sample_tensors():
        info = header.tensors[name]
        assert (info.type, info.shape) == (ggml_type, shape)
        assert read_gguf_tensor(header, name).flatten().tolist() == data.reshape(-1).view(torch.uint8).tolist()
    assert read_gguf_tensor(header, "blk.0.ffn_up_exps.weight").shape == (2, 3, 34)
    assert not [p for p in tmp_path.iterdir() if p.name != "out.gguf"], "a temporary file was left behind"


def test_written_metadata_round_trips_byte_for_byte(tmp_path: Path) -> None:
    first, second = tmp_path / "1.gguf", tmp_path / "2.gguf"
    write_gguf(first, SAMPLE_METADATA, _sample_tensors(), alignment=64)
    header = read_gguf_header(first)
    assert header.alignment == 64 and header.metadata["general.alignment"] == 64
    metadata = {key: (header.metadata_types[key], value) for key, value in header.metadata.items()}
    tensors = [(name, info.type, info.shape, read_gguf_tensor(header, name)) for name, info in header.tensors.items()]
    write_gguf(second, metadata, tensors, alignment=64)
    assert first.read_bytes() == second.read_bytes()


def test_write_then_read_with_gguf_py(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "out.gguf"
    write_gguf(path, SAMPLE_METADATA, _sample_tensors(), alignment=64)
    reader = gguf.GGUFReader(path)
    assert reader.alignment == 64
    for key, (kind, value) in SAMPLE_METADATA.items():
        field = reader.fields[key]
        kinds = [t.name for t in field.types]
        if key == "nested":  # gguf-py flattens nested arrays
            assert kinds[:2] == ["ARRAY", "ARRAY"] and field.contents() == [1, 2, 3]
            continue
        assert kinds == (["ARRAY", kind[6:-1]] if kind.startswith("ARRAY") else [kind]), key
        contents = field.contents()
        assert contents == (pytest.approx(value) if kind.startswith("F") else value), key
    tensors = {t.name: t for t in reader.tensors}
    assert list(tensors) == [name for name, *_ in _sample_tensors()]
    for name, ggml_type, shape, data in _sample_tensors():
        tensor = tensors[name]
        assert int(tensor.tensor_type) == ggml_type.id and tuple(int(s) for s in reversed(tensor.shape)) == shape
        assert tensor.data.tobytes() == data.contiguous().view(torch.uint8).numpy().tobytes(), name


def _gguf_py_file(path: Path, alignment: int | None = None) -> dict[str, np.ndarray]:
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    types = gguf.GGUFValueType
    for name, kind in [
        ("UINT8", types.UINT8),
        ("INT8", types.INT8),
        ("UINT16", types.UINT16),
        ("INT16", types.INT16),
        ("UINT32", types.UINT32),
        ("INT32", types.INT32),
        ("UINT64", types.UINT64),
        ("INT64", types.INT64),
    ]:
        writer.add_key_value(f"k.{name}", 7, kind)
        writer.add_key_value(f"a.{name}", [1, 2, 3], types.ARRAY, sub_type=kind)
    writer.add_float32("k.FLOAT32", 0.5)
    writer.add_float64("k.FLOAT64", -0.125)
    writer.add_bool("k.BOOL", False)
    writer.add_string("k.STRING", "ünïcode")
    writer.add_array("a.STRING", ["x", "yy"])
    writer.add_array("a.nested", [[1, 2], [3]])
    tensors = {
        "f32": np.arange(6, dtype=np.float32).reshape(2, 3),
        "f16": np.arange(4, dtype=np.float16),
        "q4k": np.random.default_rng(0).integers(0, 256, (3, 144), dtype=np.uint8),
        "experts": np.random.default_rng(1).integers(0, 256, (2, 3, 18), dtype=np.uint8),
    }
    writer.add_tensor("f32", tensors["f32"])
    writer.add_tensor("f16", tensors["f16"])
    writer.add_tensor("q4k", tensors["q4k"], raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    writer.add_tensor("experts", tensors["experts"], raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


@pytest.mark.parametrize("alignment", [None, 16, 128])
def test_read_a_gguf_py_file(tmp_path: Path, alignment: int | None) -> None:
    path = tmp_path / "ref.gguf"
    tensors = _gguf_py_file(path, alignment)
    header = read_gguf_header(path)
    assert header.alignment == (alignment or 32) and header.data_offset % header.alignment == 0
    for name in ("UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64"):
        assert (header.metadata_types[f"k.{name}"], header.metadata[f"k.{name}"]) == (name, 7)
        assert (header.metadata_types[f"a.{name}"], header.metadata[f"a.{name}"]) == (f"ARRAY[{name}]", [1, 2, 3])
    assert header.metadata["k.FLOAT32"] == 0.5 and header.metadata["k.FLOAT64"] == -0.125
    assert header.metadata["k.BOOL"] is False and header.metadata["k.STRING"] == "ünïcode"
    assert header.metadata["a.STRING"] == ["x", "yy"] and header.metadata["a.nested"] == [[1, 2], [3]]
    assert header.metadata_types["a.nested"] == "ARRAY[ARRAY[INT32]]"
    expected = {
        "f32": ("F32", (2, 3)),
        "f16": ("F16", (4,)),
        "q4k": ("Q4_K", (3, 256)),
        "experts": ("Q4_0", (2, 3, 32)),
    }
    for name, (type_name, shape) in expected.items():
        info = header.tensors[name]
        assert (info.type.name, info.shape) == (type_name, shape)
        assert read_gguf_tensor(header, name).numpy().tobytes() == tensors[name].tobytes()
    assert read_gguf_tensor(header, "experts").shape == (2, 3, 18)
    assert read_gguf_tensor(header, "q4k").shape == (3, 144)


def test_a_tokenizer_sized_header_parses(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    count = 150_000
    tokens = [f"tok{i}\u2581x" for i in range(count)]
    scores = [float(-i) for i in range(count)]
    token_types = [i % 6 for i in range(count)]
    path = tmp_path / "tokenizer.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(token_types)
    names = [f"blk.{i // 3}.w{i % 3}.weight" for i in range(300)]
    for index, name in enumerate(names):
        writer.add_tensor(name, np.full((2, 32), index, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    header = read_gguf_header(path)
    assert header.metadata["tokenizer.ggml.tokens"] == tokens
    assert header.metadata["tokenizer.ggml.scores"] == scores
    assert header.metadata["tokenizer.ggml.token_type"] == token_types
    assert header.metadata_types["tokenizer.ggml.scores"] == "ARRAY[FLOAT32]"
    assert list(header.tensors) == names
    last = read_gguf_tensor(header, names[-1]).view(torch.float16)
    assert last.shape == (2, 32) and bool((last == 299).all())


def test_write_refuses_an_existing_file_unless_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "out.gguf"
    path.write_bytes(b"keep")
    with pytest.raises(DestinationError, match=r"already exists.*overwrite=True"):
        write_gguf(path, {}, [])
    assert path.read_bytes() == b"keep"
    write_gguf(path, {"k": ("UINT8", 1)}, [], overwrite=True)
    assert read_gguf_header(path).metadata == {"k": 1}
    with pytest.raises(DestinationError, match="is a folder"):
        write_gguf(tmp_path, {}, [])


def test_overwriting_the_source_keeps_its_readers_bytes(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    write_gguf(path, {}, _sample_tensors())
    old = read_gguf_header(path)
    with path.open("rb") as reader:
        write_gguf(path, {}, [(n, t, s, torch.zeros_like(d)) for n, t, s, d in _sample_tensors()], overwrite=True)
        reader.seek(old.tensors["blk.0.attn_q.weight"].offset)
        assert reader.read(10) == _sample_tensors()[1][3].flatten()[:10].numpy().tobytes()


F32_TYPE = ggml_type_by_name("F32")
Q4_0_TYPE = ggml_type_by_name("Q4_0")
BAD_WRITES: list[tuple[dict[str, Any], list[Any], dict[str, Any], str]] = [
    ({"k": ("UINT8", 256)}, [], {}, r"metadata key 'k': is 256, outside UINT8's range 0 to 255"),
    ({"k": ("INT32", True)}, [], {}, r"metadata key 'k': is True, a bool"),
    ({"k": ("INT32", 1.5)}, [], {}, r"metadata key 'k': is 1.5, but a INT32 value is an integer"),
    ({"k": ("BOOL", 1)}, [], {}, r"metadata key 'k': is 1, but a BOOL value is True or False"),
    ({"k": ("FLOAT32", 1e39)}, [], {}, r"beyond FLOAT32's largest value"),
    ({"k": ("FLOAT64", "1.5")}, [], {}, r"but a FLOAT64 value is a number"),
    ({"k": ("STRING", "\ud800")}, [], {}, r"metadata key 'k': .* is not UTF-8"),
    ({"k": ("STRING", 5)}, [], {}, r"metadata key 'k': is a int"),
    ({"k": ("UINT", 5)}, [], {}, r"type 'UINT' is not a GGUF value type; allowed: UINT8"),
    ({"k": ("ARRAY[UINT]", [5])}, [], {}, r"element type 'UINT' is not a GGUF value type"),
    ({"k": ("ARRAY[UINT8]", [1, 300])}, [], {}, r"metadata key 'k' element 1: is 300"),
    ({"k": ("ARRAY[UINT8]", 5)}, [], {}, r"an ARRAY value is a list"),
    ({"k": ("ARRAY[ARRAY]", [[1]])}, [], {}, r"name the inner type"),
    ({"k": 5}, [], {}, r"not a \(type name, value\) pair"),
    ({"general.alignment": ("UINT32", 32)}, [], {"alignment": 64}, r"'general.alignment': is \('UINT32', 32\)"),
    ({}, [], {"alignment": 48}, r"alignment: is 48; it must be a power of two"),
    ({}, [("w", F32_TYPE, (2,), torch.zeros(3))], {}, r"tensor 0 'w': data has 12 bytes but F32 x \[2\] is 8 bytes"),
    (
        {},
        [("w", Q4_0_TYPE, (2, 16), torch.zeros(18, dtype=torch.uint8))],
        {},
        r"last size 16 is not a multiple of Q4_0's",
    ),
    (
        {},
        [("w", Q4_0_TYPE, (1, 32), torch.zeros(18, dtype=torch.int8))],
        {},
        r"data is torch.int8; a Q4_0 tensor's data is",
    ),
    (
        {},
        [("w", F32_TYPE, (1,), torch.zeros(1)), ("w", F32_TYPE, (1,), torch.zeros(1))],
        {},
        r"tensor 1 'w': the name is used",
    ),
    ({}, [("x" * 64, F32_TYPE, (1,), torch.zeros(1))], {}, r"the name is 64 bytes; ggml allows 1 to 63"),
    ({}, [("w", F32_TYPE, (1, 1, 1, 1, 1), torch.zeros(1))], {}, r"shape \(1, 1, 1, 1, 1\) is not a list of 0 to 4"),
    ({}, [("w", "F32", (1,), torch.zeros(1))], {}, r"type 'F32' is not one of GGML_TYPES"),
    ({}, [("w", F32_TYPE, (1,))], {}, r"tensor 0: is not a \(name, GGMLType, shape"),
]


@pytest.mark.parametrize(("metadata", "tensors", "options", "message"), BAD_WRITES)
def test_write_refuses_bad_arguments(
    tmp_path: Path, metadata: dict[str, Any], tensors: list[Any], options: dict[str, Any], message: str
) -> None:
    path = tmp_path / "out.gguf"
    with pytest.raises(UsageError, match=message) as caught:
        write_gguf(path, metadata, tensors, **options)
    assert str(path) in str(caught.value)
    assert not os.listdir(tmp_path), "a refused write left a file behind"


@pytest.mark.subprocess
def test_reading_a_header_imports_no_torch_nor_gguf(tmp_path: Path) -> None:
    """``qscheme inspect`` of a GGUF and the type table need neither torch nor the optional gguf package."""
    path = _write(tmp_path, _valid())
    code = (
        "import sys\n"
        "from qscheme.storage import read_gguf_header, ggml_type_by_name\n"
        f"header = read_gguf_header({str(path)!r})\n"
        "assert list(header.tensors) == ['a', 'b'] and ggml_type_by_name('Q8_0').block_bytes == 34\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'gguf', 'numpy'))\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
