"""Fuzz the GGUF header parser: a damaged file either reads the same tensors or raises a QSchemeError.

Two small valid files (written by ``write_gguf``: every kind of metadata value, F32, Q8_0 and 3-D
Q4_K tensors; one with the default alignment, one with ``general.alignment`` 64) are damaged one
way per run, in their header: bytes flipped, inserted or deleted, the file cut short, a count or
length field set to a huge or off-by-some value, a type or n_dims field set to an odd value, a
tensor's offset moved. ``read_gguf_header`` and then ``read_gguf_tensor`` of every tensor must
either raise a QSchemeError (nothing else: no IndexError, struct.error, MemoryError, no hang)
or give what a reader can see in the file:

- a damage outside the tensor infos that keeps every byte's place (a flipped byte inside a
  metadata string, say) must leave every tensor as it was: same name, type, shape and bytes;
- any accepted file must read the same in gguf-py's GGUFReader, the reference reader: the same
  tensor names, types, shapes and bytes (this part needs the optional ``gguf`` package).

Deterministic and bounded for CI: derandomized, no example database, a few seconds in all.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qscheme.errors import QSchemeError
from qscheme.storage import ggml_type_by_name, read_gguf_header, read_gguf_tensor, write_gguf

FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=timedelta(seconds=10),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    print_blob=False,
)
HUGE_U64 = [2**64 - 1, 2**63, 2**62, 2**32, 2**32 + 1, 10**12]
ODD_U32 = [0, 1, 3, 4, 5, 8, 9, 12, 13, 31, 42, 99, 2**16, 2**31, 2**32 - 1]
OFFSET_MOVES = [1, -1, 16, -16, 32, -32, 64, -64, 96]


def _bytes(seed: int, count: int) -> torch.Tensor:
    return torch.randint(0, 256, (count,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _sample(path: Path, alignment: int) -> None:
    metadata: dict[str, tuple[str, Any]] = {
        "general.architecture": ("STRING", "llama"),
        "llama.block_count": ("UINT32", 1),
        "llama.rope.freq_base": ("FLOAT32", 10000.0),
        "general.flag": ("BOOL", True),
        "general.big": ("INT64", -(2**40)),
        "tokenizer.ggml.tokens": ("ARRAY[STRING]", ["<s>", "</s>", "a", "bé", "▁c"]),
        "tokenizer.ggml.scores": ("ARRAY[FLOAT32]", [0.0, -1.0, -2.0, -3.0, -4.0]),
        "tokenizer.ggml.token_type": ("ARRAY[INT32]", [3, 3, 1, 1, 1]),
        "nested": ("ARRAY[ARRAY[UINT16]]", [[1, 2], [3]]),
    }
    tensors = [
        ("token_embd.weight", ggml_type_by_name("F32"), (2, 4), _bytes(1, 32)),
        ("blk.0.attn_q.weight", ggml_type_by_name("Q8_0"), (3, 64), _bytes(2, 3 * 68).reshape(3, 68)),
        ("blk.0.ffn_up_exps.weight", ggml_type_by_name("Q4_K"), (2, 1, 256), _bytes(3, 2 * 144).reshape(2, 1, 144)),
        ("output_norm.weight", ggml_type_by_name("F16"), (4,), _bytes(4, 8)),
    ]
    write_gguf(path, metadata, tensors, alignment=alignment)


@dataclass(frozen=True)
class Field:
    """One numeric field of the header, found by the walker below: where, its width, its role."""

    kind: str  # "count", "length", "type", "n_dims", "dim", "offset"
    position: int
    width: int


@dataclass(frozen=True)
class Sample:
    raw: bytes
    fields: tuple[Field, ...]
    infos_start: int  # where the tensor infos begin
    data_offset: int
    tensors: dict[str, tuple[str, tuple[int, ...], bytes]]


def _walk(raw: bytes) -> tuple[list[Field], int, int]:
    """The numeric fields of a valid file's header, its tensor infos' start and the header's end;
    written from the format's description, independently of the parser under test."""
    fields = [Field("count", 8, 8), Field("count", 16, 8)]
    tensor_count, key_count = struct.unpack_from("<QQ", raw, 8)
    pos = 24
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def string(at: int) -> int:
        fields.append(Field("length", at, 8))
        return at + 8 + struct.unpack_from("<Q", raw, at)[0]

    def value(at: int, type_id: int) -> int:
        if type_id in sizes:
            return at + sizes[type_id]
        if type_id == 8:
            return string(at)
        fields.extend([Field("type", at, 4), Field("count", at + 4, 8)])
        element, count = struct.unpack_from("<IQ", raw, at)
        at += 12
        for _ in range(count):
            at = value(at, element)
        return at

    for _ in range(key_count):
        pos = string(pos)
        fields.append(Field("type", pos, 4))
        pos = value(pos + 4, struct.unpack_from("<I", raw, pos)[0])
    infos_start = pos
    for _ in range(tensor_count):
        pos = string(pos)
        fields.append(Field("n_dims", pos, 4))
        (n_dims,) = struct.unpack_from("<I", raw, pos)
        fields.extend(Field("dim", pos + 4 + 8 * d, 8) for d in range(n_dims))
        pos += 4 + 8 * n_dims
        fields.extend([Field("type", pos, 4), Field("offset", pos + 4, 8)])
        pos += 12
    return fields, infos_start, pos


def _tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    header = read_gguf_header(path)
    return {
        name: (info.type.name, info.shape, read_gguf_tensor(header, name).numpy().tobytes())
        for name, info in header.tensors.items()
    }


@functools.cache
def _original(alignment: int, root: Path) -> Sample:
    path = root / f"sample-{alignment}.gguf"
    _sample(path, alignment)
    raw = path.read_bytes()
    fields, infos_start, header_end = _walk(raw)
    data_offset = -(-header_end // alignment) * alignment
    return Sample(raw, tuple(fields), infos_start, data_offset, _tensors(path))


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf_fuzz")


def _damage(sample: Sample, draw: Callable[..., Any]) -> tuple[bytes, bool]:
    """(damaged file, whether every byte kept its place and only bytes before the tensor infos changed)."""
    data = bytearray(sample.raw)
    kind = draw(st.sampled_from(["flip", "flip", "insert", "delete", "truncate", "field", "field", "offset"]))
    in_place = kind == "flip"
    if kind == "flip":
        for _ in range(draw(st.integers(1, 3))):
            position = draw(st.integers(0, sample.data_offset - 1))
            data[position] ^= draw(st.integers(1, 255))
            in_place = in_place and position < sample.infos_start
    elif kind in ("insert", "delete"):
        position = draw(st.integers(4, sample.data_offset - 1))
        if kind == "insert":
            data[position:position] = bytes([draw(st.integers(0, 255))]) * draw(st.sampled_from([1, 4, 8, 32]))
        else:
            del data[position : position + draw(st.sampled_from([1, 4, 8, 32]))]
    elif kind == "truncate":
        del data[draw(st.integers(0, len(data) - 1)) :]
    elif kind == "field":
        field = draw(st.sampled_from(sample.fields))
        (old,) = struct.unpack_from("<Q" if field.width == 8 else "<I", data, field.position)
        if field.width == 8:
            new = draw(st.sampled_from([*HUGE_U64, old + 1, max(old - 1, 0), old * 2, 0, len(data)]))
        else:
            new = draw(st.sampled_from(ODD_U32))
        struct.pack_into("<Q" if field.width == 8 else "<I", data, field.position, new % 2 ** (8 * field.width))
    else:
        offsets = [field for field in sample.fields if field.kind == "offset"]
        field = draw(st.sampled_from(offsets))
        (old,) = struct.unpack_from("<Q", data, field.position)
        struct.pack_into("<Q", data, field.position, max(old + draw(st.sampled_from(OFFSET_MOVES)), 0))
    return bytes(data), in_place


def _reference_tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(path)
    return {
        tensor.name: (
            gguf.GGMLQuantizationType(int(tensor.tensor_type)).name,
            tuple(int(size) for size in reversed(tensor.shape.tolist())),
            tensor.data.tobytes(),
        )
        for tensor in reader.tensors
    }


@settings(FUZZ, max_examples=400)
@given(st.data())
def test_a_damaged_header_reads_the_same_or_raises(root: Path, data: st.DataObject) -> None:
    sample = _original(data.draw(st.sampled_from([32, 64])), root)
    raw, in_place = _damage(sample, data.draw)
    path = root / "case.gguf"
    path.write_bytes(raw)
    try:
        tensors = _tensors(path)
    except QSchemeError:
        return
    if in_place:
        assert tensors == sample.tensors
    try:
        import gguf  # noqa: F401
    except ImportError:
        return
    assert tensors == _reference_tensors(path), "qscheme and gguf-py read the accepted file differently"


def test_the_walker_finds_every_tensor_offset(root: Path) -> None:
    """The damage above reaches each tensor's offset field (the walker reads the file correctly)."""
    for alignment in (32, 64):
        sample = _original(alignment, root)
        offsets = [struct.unpack_from("<Q", sample.raw, f.position)[0] for f in sample.fields if f.kind == "offset"]
        header = read_gguf_header(root / f"sample-{alignment}.gguf")
        assert [header.data_offset + offset for offset in offsets] == [t.offset for t in header.tensors.values()]
        assert sample.data_offset == header.data_offset


@settings(FUZZ, max_examples=40)
@given(st.data())
def test_a_moved_offset_is_refused(root: Path, data: st.DataObject) -> None:
    """gguf-py would read a moved tensor at its new place, agreeing with a reader that lacked the
    layout check; so a move (unaligned, onto another tensor, or leaving a gap) must be refused."""
    sample = _original(data.draw(st.sampled_from([32, 64])), root)
    offsets = [field for field in sample.fields if field.kind == "offset"]
    field = data.draw(st.sampled_from(offsets))
    raw = bytearray(sample.raw)
    (old,) = struct.unpack_from("<Q", raw, field.position)
    moves = [move for move in OFFSET_MOVES if old + move >= 0]
    struct.pack_into("<Q", raw, field.position, old + data.draw(st.sampled_from(moves)))
    path = root / "moved.gguf"
    path.write_bytes(bytes(raw))
    with pytest.raises(QSchemeError, match=r"tensor \d '[^']+' offset \(at byte"):
        read_gguf_header(path)
