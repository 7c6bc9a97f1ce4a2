"""One GGUF file's header (v2 and v3, little-endian), parsed and checked at least as strictly as llama.cpp.

A header qscheme accepts is one llama.cpp's ``gguf_init_from_file`` accepts too, and a hostile
one gets a CheckpointError naming the file, the field, its byte position and the bad value,
never a traceback, a hang or an allocation larger than the file. Torch-free. Checked, in order:

- the magic ``GGUF`` and the version: 2 or 3 (1, the first draft with 32-bit counts, and
  big-endian files are refused with a message saying so);
- every count and length against the bytes left before anything is read or allocated: the
  tensor and key counts, each string's length, each array's count (times the smallest size one
  element can have); the whole header fits in ``MAX_HEADER_BYTES`` (safetensors' own bound);
- metadata: keys UTF-8 and never twice, a known value type, strings UTF-8, booleans 0 or 1,
  arrays nested at most ``MAX_ARRAY_DEPTH`` deep; ``general.alignment`` a UINT32 power of two;
- each tensor: a UTF-8 name of at most 63 bytes (ggml's limit) never used twice, at most 4
  dimensions, each and their product below 2**63, a known ggml type whose block divides dims[0];
- the data section: it starts at the header's end rounded up to the alignment, and each tensor
  starts where the previous one's data, padded to the alignment, ends (llama.cpp's rule: no
  overlap, no gap, every offset aligned), its bytes inside the file.

Metadata values become Python values: ints, floats, bools, str, lists (numeric arrays are read
in bulk, so a 150k-entry tokenizer parses in well under a second); ``metadata_types`` keeps each
key's GGUF type (``"UINT32"``, ``"ARRAY[STRING]"``, ``"ARRAY[ARRAY[INT32]]"``).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from qscheme.errors import CheckpointError
from qscheme.storage.gguf_types import (
    ARRAY_TYPE_ID,
    GGML_TYPES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAX_DIMS,
    GGUF_MAX_NAME_BYTES,
    GGUF_SCALAR_TYPES,
    GGUF_VALUE_TYPES,
    STRING_TYPE_ID,
    GGMLType,
)
from qscheme.text import shown, shown_file

__all__ = ["MAX_ARRAY_DEPTH", "MAX_GGUF_HEADER_BYTES", "GGUFHeader", "GGUFTensorInfo", "read_gguf_header"]

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_GGUF_HEADER_BYTES = 100_000_000  # a real header (a 262k-token vocabulary included) is a few MB
MAX_ARRAY_DEPTH = 8  # real files nest arrays at most 2 deep
MAX_INT64 = 2**63 - 1  # ggml holds each dimension and the element count in an int64
ALIGNMENT_KEY = "general.alignment"
_FIX = "the file is truncated or not a GGUF; re-download or re-convert it"
_READ_AHEAD = 1 << 20
_SCALARS_BY_ID = {t.id: t for t in GGUF_SCALAR_TYPES.values()}
# The fewest bytes one element of each value type takes (an array element: type, count, nothing).
_MIN_BYTES = {**{t.id: t.size for t in GGUF_SCALAR_TYPES.values()}, STRING_TYPE_ID: 8, ARRAY_TYPE_ID: 12}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's entry: its ggml type, ``dims`` as stored (dims[0] varies fastest: K of a
    weight), where its data starts in the file (``offset``, absolute) and how many bytes it has."""

    name: str
    type: GGMLType
    dims: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape in torch order (``dims`` reversed): a weight [N, K], stacked experts [E, N, K]."""
        return tuple(reversed(self.dims))

    @property
    def row_bytes(self) -> int:
        """Bytes of one row, a run of dims[0] values (the type's block bytes for a 0-dim tensor)."""
        return self.type.row_bytes(self.dims[0] if self.dims else 1)

    @property
    def rows(self) -> int:
        """How many rows: the product of dims[1:] (1 for a 0- or 1-dim tensor)."""
        count = 1
        for size in self.dims[1:]:
            count *= size
        return count


@dataclass(frozen=True)
class GGUFHeader:
    """One GGUF file's checked header, and the file's identity when it was read (to notice a rewrite)."""

    path: Path
    version: int
    alignment: int
    metadata: Mapping[str, Any]
    metadata_types: Mapping[str, str]
    tensors: Mapping[str, GGUFTensorInfo]  # in file order
    data_offset: int
    file_size: int
    identity: tuple[int, int, int] = (0, 0, 0)  # (device, inode, mtime in ns)


class _Cursor:
    """The header's bytes, read from the file in chunks as the parser asks for them, never past
    the file's end or ``MAX_GGUF_HEADER_BYTES``; ``fail`` builds the located CheckpointError."""

    def __init__(self, handle: BinaryIO, path: Path, file_size: int) -> None:
        self.handle = handle
        self.file = shown_file(path)
        self.file_size = file_size
        self.limit = min(file_size, MAX_GGUF_HEADER_BYTES)
        self.buffer = bytearray()
        self.pos = 0

    def fail(self, where: str, message: str, at: int | None = None, fix: str = _FIX) -> CheckpointError:
        position = self.pos if at is None else at
        return CheckpointError(f"{self.file}: {where} (at byte {position:,}): {message}; {fix}")

    def left(self) -> int:
        return self.limit - self.pos

    def room(self) -> str:
        """What is left and what bounds it, for a message."""
        left = max(self.left(), 0)
        if self.limit == self.file_size:
            return f"only {left:,} bytes are left: the file ends at byte {self.file_size:,}"
        return f"only {left:,} bytes are left in a header longer than {MAX_GGUF_HEADER_BYTES:,} bytes (qscheme's bound)"

    def need(self, count: int, where: str) -> None:
        """Make ``count`` bytes from ``pos`` available in ``buffer``, or fail naming ``where``."""
        end = self.pos + count
        if end <= len(self.buffer):
            return
        if end > self.limit:
            if self.limit == self.file_size:
                raise self.fail(where, f"needs {count:,} bytes but the file ends at byte {self.file_size:,}")
            raise self.fail(
                where,
                f"needs {count:,} bytes, which would make the header longer than {MAX_GGUF_HEADER_BYTES:,} bytes "
                "(qscheme's bound, as safetensors bounds its header; real GGUF headers are a few MB)",
            )
        wanted = min(self.limit, max(end, len(self.buffer) + _READ_AHEAD)) - len(self.buffer)
        chunk = self.handle.read(wanted)
        self.buffer += chunk
        if len(chunk) < wanted and end > len(self.buffer):
            raise self.fail(where, "the file shrank while its header was read", fix="is another program writing it?")

    def unpack(self, code: str, size: int, where: str) -> Any:
        self.need(size, where)
        (value,) = struct.unpack_from(code, self.buffer, self.pos)
        self.pos += size
        return value

    def u32(self, where: str) -> int:
        return int(self.unpack("<I", 4, where))

    def u64(self, where: str) -> int:
        return int(self.unpack("<Q", 8, where))

    def text(self, length: int, where: str) -> str:
        """``length`` bytes at ``pos`` as UTF-8 (``pos`` is past the u64 length)."""
        self.need(length, where)
        raw = self.buffer[self.pos : self.pos + length]
        try:
            value = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            bad = bytes(raw[exc.start : exc.start + 4])
            raise self.fail(where, f"is not UTF-8 ({exc.reason}: {bad!r})", at=self.pos + exc.start) from None
        self.pos += length
        return value

    def string(self, where: str) -> str:
        start = self.pos
        length = self.u64(f"{where} length")
        if length > self.left():
            raise self.fail(
                f"{where} length",
                f"is {length:,} bytes but {self.room()}",
                at=start,
            )
        return self.text(length, where)


def _check_count(cursor: _Cursor, where: str, count: int, each: int, at: int) -> None:
    """``count`` items of at least ``each`` bytes fit in what is left of the header."""
    if count * each > cursor.left():
        raise cursor.fail(
            where,
            f"is {count:,}, which needs at least {count * each:,} bytes but {cursor.room()}",
            at=at,
        )


def _value_type(cursor: _Cursor, where: str) -> int:
    at = cursor.pos
    type_id = cursor.u32(where)
    if type_id not in GGUF_VALUE_TYPES:
        allowed = ", ".join(f"{i} {name}" for i, name in GGUF_VALUE_TYPES.items())
        raise cursor.fail(where, f"is {type_id}, not a GGUF value type ({allowed})", at=at)
    return type_id


def _array(cursor: _Cursor, where: str, depth: int) -> tuple[list[Any], str]:
    if depth > MAX_ARRAY_DEPTH:
        raise cursor.fail(where, f"nests arrays more than {MAX_ARRAY_DEPTH} deep (real files nest at most 2)")
    element = _value_type(cursor, f"{where} element type")
    at = cursor.pos
    count = cursor.u64(f"{where} count")
    _check_count(cursor, f"{where} count", count, _MIN_BYTES[element], at)
    scalar = _SCALARS_BY_ID.get(element)
    if scalar is not None:
        size = count * scalar.size
        cursor.need(size, f"{where} elements")
        values = list(struct.unpack_from(f"<{count}{scalar.code}", cursor.buffer, cursor.pos))
        if scalar.name == "BOOL":
            bad = next((i for i, v in enumerate(values) if v > 1), None)
            if bad is not None:
                raise cursor.fail(
                    f"{where} element {bad}", f"is {values[bad]}, but a BOOL is 0 or 1", at=cursor.pos + bad
                )
            values = [v == 1 for v in values]
        cursor.pos += size
        return values, f"ARRAY[{scalar.name}]"
    if element == STRING_TYPE_ID:
        return _strings(cursor, where, count), "ARRAY[STRING]"
    items, kinds = [], set()
    for index in range(count):
        item, kind = _array(cursor, f"{where} element {index}", depth + 1)
        items.append(item)
        kinds.add(kind)
    inner = kinds.pop() if len(kinds) == 1 else "ARRAY"  # arrays of mixed (or no) element types
    return items, f"ARRAY[{inner}]"


def _strings(cursor: _Cursor, where: str, count: int) -> list[str]:
    """``count`` strings, in one loop with few calls: a tokenizer holds 150k of them."""
    values = []
    buffer, unpack = cursor.buffer, struct.Struct("<Q").unpack_from
    pos = cursor.pos
    for index in range(count):
        if pos + 8 > len(buffer):
            cursor.pos = pos
            cursor.need(8, f"{where} element {index} length")
        (length,) = unpack(buffer, pos)
        if pos + 8 + length > len(buffer):
            cursor.pos = pos
            if length > cursor.left() - 8:
                cursor.pos = pos + 8
                raise cursor.fail(f"{where} element {index} length", f"is {length:,} bytes but {cursor.room()}", at=pos)
            cursor.need(8 + length, f"{where} element {index}")
        pos += 8
        try:
            values.append(buffer[pos : pos + length].decode("utf-8"))
        except UnicodeDecodeError:
            cursor.pos = pos
            cursor.text(length, f"{where} element {index}")  # raises, locating the bad byte
        pos += length
    cursor.pos = pos
    return values


def _value(cursor: _Cursor, type_id: int, where: str) -> tuple[Any, str]:
    scalar = _SCALARS_BY_ID.get(type_id)
    if scalar is not None:
        at = cursor.pos
        value = cursor.unpack(f"<{scalar.code}", scalar.size, where)
        if scalar.name == "BOOL":
            if value > 1:
                raise cursor.fail(where, f"is {value}, but a BOOL is 0 or 1", at=at)
            value = value == 1
        return value, scalar.name
    if type_id == STRING_TYPE_ID:
        return cursor.string(where), "STRING"
    return _array(cursor, where, 1)


def _metadata(cursor: _Cursor, count: int) -> tuple[dict[str, Any], dict[str, str], dict[str, int]]:
    """(values, types, byte position of each value) of ``count`` key-value pairs."""
    values: dict[str, Any] = {}
    types: dict[str, str] = {}
    positions: dict[str, int] = {}
    for index in range(count):
        at = cursor.pos
        key = cursor.string(f"metadata key {index}")
        where = f"metadata key '{shown(key)}'"
        if key in values:
            raise cursor.fail(where, "appears twice; a GGUF key is unique (which value is meant is unknown)", at=at)
        type_id = _value_type(cursor, f"{where} value type")
        positions[key] = cursor.pos
        values[key], types[key] = _value(cursor, type_id, where)
    return values, types, positions


def _alignment(cursor: _Cursor, values: Mapping[str, Any], types: Mapping[str, str], at: Mapping[str, int]) -> int:
    if ALIGNMENT_KEY not in values:
        return GGUF_DEFAULT_ALIGNMENT
    where = f"metadata key {ALIGNMENT_KEY!r}"
    if types[ALIGNMENT_KEY] != "UINT32":
        raise cursor.fail(where, f"is a {types[ALIGNMENT_KEY]}, but it must be a UINT32", at=at[ALIGNMENT_KEY])
    value = values[ALIGNMENT_KEY]
    if value <= 0 or value & (value - 1):
        raise cursor.fail(where, f"is {value}, but it must be a power of two (e.g. 32)", at=at[ALIGNMENT_KEY])
    return int(value)


def _tensor(cursor: _Cursor, index: int, names: set[str]) -> tuple[str, GGMLType, tuple[int, ...], int, int, int]:
    """(name, type, dims, relative offset, byte count, position of the offset field) of tensor ``index``."""
    at = cursor.pos
    name = cursor.string(f"tensor {index} name")
    where = f"tensor {index} '{shown(name)}'"
    if len(name.encode("utf-8")) > GGUF_MAX_NAME_BYTES:
        raise cursor.fail(
            f"{where} name", f"is {len(name.encode())} bytes long; ggml allows at most {GGUF_MAX_NAME_BYTES}", at=at
        )
    if name in names:
        raise cursor.fail(f"{where} name", "appears twice; tensor names are unique in a GGUF", at=at)
    at = cursor.pos
    n_dims = cursor.u32(f"{where} n_dims")
    if n_dims > GGUF_MAX_DIMS:
        raise cursor.fail(f"{where} n_dims", f"is {n_dims}; ggml tensors have 0 to {GGUF_MAX_DIMS} dimensions", at=at)
    dims_at = at = cursor.pos
    cursor.need(8 * n_dims, f"{where} dims")
    dims = struct.unpack_from(f"<{n_dims}Q", cursor.buffer, cursor.pos)
    cursor.pos += 8 * n_dims
    rows = 1
    for size in dims[1:]:
        rows *= size
    elements = rows * (dims[0] if dims else 1)
    if any(size > MAX_INT64 for size in dims) or elements > MAX_INT64:
        raise cursor.fail(
            f"{where} dims",
            f"are {list(dims)}: each size and their product must stay below 2**63 (ggml's int64)",
            at=at,
        )
    at = cursor.pos
    type_id = cursor.u32(f"{where} type")
    ggml_type = GGML_TYPES.get(type_id)
    if ggml_type is None:
        known = ", ".join(f"{t.id} {t.name}" for t in GGML_TYPES.values())
        raise cursor.fail(f"{where} type", f"is {type_id}, not a ggml type qscheme knows ({known})", at=at)
    first = dims[0] if dims else 1
    if first % ggml_type.block_elements:
        raise cursor.fail(
            f"{where} dims",
            f"dims[0] is {first}, not a multiple of {ggml_type.name}'s block of {ggml_type.block_elements} values",
            at=dims_at,
        )
    nbytes = ggml_type.row_bytes(first) * rows
    offset_at = cursor.pos
    offset = cursor.u64(f"{where} offset")
    return name, ggml_type, tuple(dims), offset, nbytes, offset_at


def _padded(size: int, alignment: int) -> int:
    return -(-size // alignment) * alignment


def _version(cursor: _Cursor) -> int:
    cursor.need(8, "the magic and version")
    magic = bytes(cursor.buffer[:4])
    if magic != GGUF_MAGIC:
        raise cursor.fail("the magic", f"is {magic!r}, not {GGUF_MAGIC!r}: not a GGUF file", at=0)
    cursor.pos = 4
    version = cursor.u32("the version")
    if version in SUPPORTED_VERSIONS:
        return version
    if version == 1:
        message = "is 1, the first draft of GGUF (32-bit counts), which qscheme does not read"
        fix = "re-convert the model with a current llama.cpp (convert_hf_to_gguf.py), which writes version 3"
    elif version & 0xFFFF == 0 and int.from_bytes(version.to_bytes(4, "little"), "big") in SUPPORTED_VERSIONS:
        message = f"is {version:#010x}: a big-endian GGUF, which qscheme does not read"
        fix = "convert the model to a little-endian GGUF (llama.cpp's default)"
    else:
        message = f"is {version}; qscheme reads GGUF versions {' and '.join(map(str, SUPPORTED_VERSIONS))}"
        fix = _FIX
    raise cursor.fail("the version", message, at=4, fix=fix)


def _parse(cursor: _Cursor, path: Path, identity: tuple[int, int, int]) -> GGUFHeader:
    version = _version(cursor)
    at = cursor.pos
    tensor_count = cursor.u64("the tensor count")
    _check_count(cursor, "the tensor count", tensor_count, 24, at)  # name length, n_dims, type, offset
    at = cursor.pos
    key_count = cursor.u64("the metadata key count")
    _check_count(cursor, "the metadata key count", key_count, 13, at)  # key length, type, a one-byte value
    values, types, positions = _metadata(cursor, key_count)
    alignment = _alignment(cursor, values, types, positions)
    entries = []
    names: set[str] = set()
    expected = 0  # where the next tensor must start in the data section
    previous = None
    for index in range(tensor_count):
        name, ggml_type, dims, offset, nbytes, at = _tensor(cursor, index, names)
        where = f"tensor {index} '{shown(name)}' offset"
        if offset % alignment:
            raise cursor.fail(where, f"is {offset:,}, not a multiple of the alignment {alignment}", at=at)
        if offset != expected:
            expected_text = f"after tensor '{shown(previous)}' that is {expected:,}" if previous else "the first at 0"
            relation = "inside the data of an earlier tensor" if offset < expected else "after a gap"
            raise cursor.fail(
                where,
                f"is {offset:,} ({relation}); each tensor starts where the previous one's data, padded to the "
                f"alignment, ends, as llama.cpp requires: {expected_text}",
                at=at,
            )
        names.add(name)
        entries.append((name, ggml_type, dims, offset, nbytes, at))
        expected += _padded(nbytes, alignment)
        previous = name
    data_offset = _padded(cursor.pos, alignment)
    tensors: dict[str, GGUFTensorInfo] = {}
    for index, (name, ggml_type, dims, offset, nbytes, at) in enumerate(entries):
        end = data_offset + offset + nbytes
        if end > cursor.file_size:
            raise cursor.fail(
                f"tensor {index} '{shown(name)}' offset",
                f"{ggml_type.name} x {list(dims)} is {nbytes:,} bytes from byte {data_offset + offset:,}, ending at "
                f"{end:,}, past the file's end at {cursor.file_size:,}",
                at=at,
            )
        tensors[name] = GGUFTensorInfo(name, ggml_type, dims, data_offset + offset, nbytes)
    return GGUFHeader(
        path=path,
        version=version,
        alignment=alignment,
        metadata=values,
        metadata_types=types,
        tensors=tensors,
        data_offset=data_offset,
        file_size=cursor.file_size,
        identity=identity,
    )


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Parse and check one GGUF file's header; CheckpointError naming the file, field and byte."""
    path = Path(path)
    try:
        with path.open("rb") as handle:
            stat = os.fstat(handle.fileno())
            identity = (stat.st_dev, stat.st_ino, stat.st_mtime_ns)
            return _parse(_Cursor(handle, path, stat.st_size), path, identity)
    except OSError as exc:
        raise CheckpointError(f"{shown_file(path)}: cannot be read: {exc.strerror or exc}") from None
