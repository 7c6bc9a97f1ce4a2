"""Writing a GGUF file (version 3, little-endian) from typed metadata and tensors' raw bytes.

Everything is checked before the file is created: each metadata value against its declared type
(ranges, UTF-8, 0-or-1 booleans), each tensor's name (unique, at most 63 UTF-8 bytes), shape (at
most 4 dimensions, the last a multiple of its type's block) and byte count (what its ggml type
and shape need). A bad argument is a UsageError naming the key or tensor, the value and what is
allowed. The file is written as llama.cpp and gguf-py write it (each tensor's data padded to the
alignment, the last one included) into a temporary file beside ``path``, flushed to the disk
(fsync), and renamed into place: a reader never sees half a file, and a failure leaves nothing
behind. An existing ``path`` is refused unless ``overwrite=True``; replacing it swaps in a new
file, so a reader of the old one (even the source of these tensors) keeps reading the old bytes.

Metadata is ``{key: (type, value)}``, types named as ``GGUFHeader.metadata_types`` names them:
``"UINT8"`` ... ``"FLOAT64"``, ``"BOOL"``, ``"STRING"``, ``"ARRAY[INT32]"``,
``"ARRAY[ARRAY[STRING]]"`` (``"ARRAY[ARRAY]"`` only for an empty list); so a header's own
metadata can be written back unchanged: ``{k: (header.metadata_types[k], v) for k, v in
header.metadata.items()}``.
"""

from __future__ import annotations

import math
import operator
import os
import secrets
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from qscheme.errors import DestinationError, UsageError
from qscheme.storage.gguf_header import ALIGNMENT_KEY, GGUF_MAGIC
from qscheme.storage.gguf_types import (
    GGML_TYPES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAX_DIMS,
    GGUF_MAX_NAME_BYTES,
    GGUF_SCALAR_TYPES,
    GGUF_VALUE_TYPE_IDS,
    GGMLType,
)
from qscheme.storage.shards import tensor_bytes
from qscheme.text import shown

__all__ = ["GGUFMetadataValue", "GGUFTensorEntry", "write_gguf"]

GGUFMetadataValue = tuple[str, Any]  # (GGUF value type name, value)
GGUFTensorEntry = tuple[str, GGMLType, Sequence[int], torch.Tensor]  # (name, type, torch shape, raw bytes)

WRITTEN_VERSION = 3
# Torch dtypes a plain ggml type's data may come in (besides uint8 bytes, which every type takes).
_PLAIN_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
}
_INTEGER_RANGES = {
    name: (-(2 ** (8 * t.size - 1)), 2 ** (8 * t.size - 1) - 1) if t.code.islower() else (0, 2 ** (8 * t.size) - 1)
    for name, t in GGUF_SCALAR_TYPES.items()
    if t.code in "bBhHiIqQ" and name != "BOOL"
}
_FLOAT32_MAX = 3.4028234663852886e38
_TYPE_NAMES = ", ".join([*GGUF_SCALAR_TYPES, "STRING", "ARRAY[<type>]"])


class _Encoder:
    """The header's bytes, appended field by field; ``fail`` builds the UsageError for ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.parts: list[bytes] = []

    def fail(self, where: str, message: str) -> UsageError:
        return UsageError(f"write_gguf: {self.path}: {where}: {message}")

    def text(self, where: str, value: object) -> bytes:
        if not isinstance(value, str):
            raise self.fail(where, f"is a {type(value).__name__} ({shown(repr(value), 60)}), not a str")
        try:
            return value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise self.fail(where, f"'{shown(value, 60)}' is not UTF-8 text ({exc.reason})") from None

    def string(self, where: str, value: object) -> None:
        raw = self.text(where, value)
        self.parts += [struct.pack("<Q", len(raw)), raw]

    def value(self, where: str, kind: str, value: Any) -> None:
        """Append ``value`` of GGUF type ``kind`` (no type id: the caller writes it)."""
        if kind == "STRING":
            self.string(where, value)
        elif kind.startswith("ARRAY[") and kind.endswith("]"):
            self.array(where, kind[6:-1], value)
        elif kind in GGUF_SCALAR_TYPES:
            self.parts.append(self.scalars(where, kind, [value], single=True))
        else:
            raise self.fail(where, f"type '{shown(kind, 60)}' is not a GGUF value type; allowed: {_TYPE_NAMES}")

    def array(self, where: str, element: str, values: Any) -> None:
        if not isinstance(values, (list, tuple)):
            raise self.fail(where, f"is a {type(values).__name__}, but an ARRAY value is a list")
        if element == "ARRAY" and values:
            raise self.fail(where, "ARRAY[ARRAY] holds only an empty list; name the inner type: ARRAY[ARRAY[INT32]]")
        inner = "ARRAY" if element.startswith("ARRAY") else element
        if inner not in GGUF_VALUE_TYPE_IDS:
            raise self.fail(
                where, f"element type '{shown(element, 60)}' is not a GGUF value type; allowed: {_TYPE_NAMES}"
            )
        self.parts.append(struct.pack("<IQ", GGUF_VALUE_TYPE_IDS[inner], len(values)))
        if inner in GGUF_SCALAR_TYPES:
            self.parts.append(self.scalars(where, inner, values, single=False))
            return
        for index, item in enumerate(values):
            self.value(f"{where} element {index}", element, item)

    def scalars(self, where: str, kind: str, values: Sequence[Any], single: bool) -> bytes:
        """``values`` of scalar type ``kind`` packed in one call, each checked first."""
        scalar = GGUF_SCALAR_TYPES[kind]
        checked: list[Any] = []
        for index, value in enumerate(values):
            here = where if single else f"{where} element {index}"
            checked.append(self._scalar(here, kind, value))
        try:
            return struct.pack(f"<{len(checked)}{scalar.code}", *checked)
        except (struct.error, OverflowError) as exc:  # a float beyond FLOAT32's range
            raise self.fail(where, f"a value does not fit a {kind} ({exc})") from None

    def _scalar(self, where: str, kind: str, value: Any) -> Any:
        if kind == "BOOL":
            if not isinstance(value, bool):
                raise self.fail(where, f"is {shown(repr(value), 60)}, but a BOOL value is True or False")
            return int(value)
        if isinstance(value, bool):
            raise self.fail(where, f"is {value}, a bool; a {kind} value is a number")
        if kind in _INTEGER_RANGES:
            low, high = _INTEGER_RANGES[kind]
            try:
                number = operator.index(value)
            except TypeError:
                raise self.fail(where, f"is {shown(repr(value), 60)}, but a {kind} value is an integer") from None
            if not low <= number <= high:
                raise self.fail(where, f"is {number}, outside {kind}'s range {low} to {high}")
            return number
        try:
            if isinstance(value, (str, bytes)):
                raise TypeError(value)
            real = float(value)  # ints and numpy floats too
        except (TypeError, ValueError, OverflowError):
            raise self.fail(where, f"is {shown(repr(value), 60)}, but a {kind} value is a number") from None
        if kind == "FLOAT32" and math.isfinite(real) and abs(real) > _FLOAT32_MAX:
            raise self.fail(where, f"is {real}, beyond FLOAT32's largest value {_FLOAT32_MAX}")
        return real


def _metadata(encoder: _Encoder, metadata: Mapping[str, GGUFMetadataValue], alignment: int) -> int:
    """Append the key-value pairs (``general.alignment`` first when it is not the default and
    absent); the number of pairs."""
    items = list(metadata.items())
    if ALIGNMENT_KEY in metadata:
        if tuple(metadata[ALIGNMENT_KEY]) != ("UINT32", alignment):
            raise encoder.fail(
                f"metadata key {ALIGNMENT_KEY!r}",
                f"is {metadata[ALIGNMENT_KEY]!r} but alignment={alignment}; give ('UINT32', {alignment}) or leave it "
                "out (it is written from alignment)",
            )
    elif alignment != GGUF_DEFAULT_ALIGNMENT:
        items.insert(0, (ALIGNMENT_KEY, ("UINT32", alignment)))
    for key, entry in items:
        where = f"metadata key '{shown(key)}'" if isinstance(key, str) else f"metadata key {key!r}"
        encoder.string(where, key)
        if not isinstance(entry, tuple) or len(entry) != 2 or not isinstance(entry[0], str):
            raise encoder.fail(
                where, f"is {shown(repr(entry), 60)}, not a (type name, value) pair such as ('UINT32', 7)"
            )
        kind, value = entry
        type_name = "ARRAY" if kind.startswith("ARRAY[") else kind
        if type_name not in GGUF_VALUE_TYPE_IDS:
            raise encoder.fail(where, f"type '{shown(kind, 60)}' is not a GGUF value type; allowed: {_TYPE_NAMES}")
        encoder.parts.append(struct.pack("<I", GGUF_VALUE_TYPE_IDS[type_name]))
        encoder.value(where, kind, value)
    return len(items)


def _padded(size: int, alignment: int) -> int:
    return -(-size // alignment) * alignment


def _tensor_data(encoder: _Encoder, index: int, entry: object, names: set[str]) -> tuple[str, memoryview, int]:
    """Check one (name, type, shape, bytes) entry; append its info (offset to come: see the caller);
    (name, its bytes, its byte count)."""
    if not isinstance(entry, (tuple, list)) or len(entry) != 4:
        raise encoder.fail(f"tensor {index}", "is not a (name, GGMLType, shape, uint8 tensor of raw bytes) tuple")
    name, ggml_type, shape, data = entry
    raw_name = encoder.text(f"tensor {index} name", name)
    where = f"tensor {index} '{shown(name)}'"
    if not raw_name or len(raw_name) > GGUF_MAX_NAME_BYTES:
        raise encoder.fail(where, f"the name is {len(raw_name)} bytes; ggml allows 1 to {GGUF_MAX_NAME_BYTES}")
    if name in names:
        raise encoder.fail(where, "the name is used twice; tensor names are unique in a GGUF")
    if not isinstance(ggml_type, GGMLType) or GGML_TYPES.get(ggml_type.id) != ggml_type:
        raise encoder.fail(where, f"type {ggml_type!r} is not one of GGML_TYPES (use ggml_type_by_name('Q4_K'))")
    try:
        sizes = [operator.index(s) for s in shape] if isinstance(shape, (tuple, list, torch.Size)) else None
    except TypeError:
        sizes = None
    if sizes is None or len(sizes) > GGUF_MAX_DIMS or any(s < 0 for s in sizes):
        raise encoder.fail(where, f"shape {shape!r} is not a list of 0 to {GGUF_MAX_DIMS} sizes >= 0 (torch order)")
    dims = sizes[::-1]
    first = dims[0] if dims else 1
    if first % ggml_type.block_elements:
        raise encoder.fail(
            where,
            f"shape {sizes}: its last size {first} is not a multiple of {ggml_type.name}'s block of "
            f"{ggml_type.block_elements} values",
        )
    rows = 1
    for size in dims[1:]:
        rows *= size
    nbytes = ggml_type.row_bytes(first) * rows
    if not isinstance(data, torch.Tensor):
        raise encoder.fail(where, f"data is a {type(data).__name__}, not a torch.Tensor of raw bytes")
    if data.dtype not in (torch.uint8, _PLAIN_DTYPES.get(ggml_type.name)):
        plain = f" or {_PLAIN_DTYPES[ggml_type.name]}" if ggml_type.name in _PLAIN_DTYPES else ""
        raise encoder.fail(where, f"data is {data.dtype}; a {ggml_type.name} tensor's data is torch.uint8 bytes{plain}")
    raw = tensor_bytes(data)
    if raw.numel() != nbytes:
        raise encoder.fail(
            where,
            f"data has {raw.numel():,} bytes but {ggml_type.name} x {sizes} is {nbytes:,} bytes "
            f"({rows} rows of {ggml_type.row_bytes(first)})",
        )
    names.add(name)
    encoder.string(f"tensor {index} name", name)
    encoder.parts.append(struct.pack(f"<I{len(dims)}QI", len(dims), *dims, ggml_type.id))
    return name, raw.numpy().data.cast("B"), nbytes


def _write_all(descriptor: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view.nbytes:
        view = view[os.write(descriptor, view) :]


def _sync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_gguf(
    path: str | Path,
    metadata: Mapping[str, GGUFMetadataValue],
    tensors: Sequence[GGUFTensorEntry],
    *,
    alignment: int = GGUF_DEFAULT_ALIGNMENT,
    overwrite: bool = False,
) -> None:
    """Write a GGUF v3 file at ``path``, atomically: ``metadata`` as ``{key: (type name, value)}``,
    ``tensors`` in order as (name, GGMLType, shape in torch order, raw bytes). UsageError naming
    the key or tensor for a bad argument; DestinationError when ``path`` exists (without
    ``overwrite``) or the file cannot be written."""
    path = Path(path)
    encoder = _Encoder(path)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1) or alignment >= 2**32:
        raise encoder.fail("alignment", f"is {alignment!r}; it must be a power of two below 2**32 (default 32)")
    encoder.parts.append(GGUF_MAGIC + struct.pack("<I", WRITTEN_VERSION))
    counts = len(encoder.parts)
    encoder.parts.append(b"")  # the counts, once known
    key_count = _metadata(encoder, metadata, alignment)
    names: set[str] = set()
    layout: list[tuple[memoryview, int]] = []
    offset = 0
    for index, entry in enumerate(tensors):
        _, view, nbytes = _tensor_data(encoder, index, entry, names)
        encoder.parts.append(struct.pack("<Q", offset))
        layout.append((view, nbytes))
        offset += _padded(nbytes, alignment)
    encoder.parts[counts] = struct.pack("<QQ", len(layout), key_count)
    header = b"".join(encoder.parts)
    header += bytes(_padded(len(header), alignment) - len(header))
    _write_file(path, header, layout, alignment, overwrite)


def _write_file(
    path: Path, header: bytes, layout: list[tuple[memoryview, int]], alignment: int, overwrite: bool
) -> None:
    if path.is_dir():
        raise DestinationError(f"write_gguf: {path}: is a folder; name the .gguf file to write")
    if not overwrite and os.path.lexists(path):
        raise DestinationError(f"write_gguf: {path}: already exists; remove it or pass overwrite=True")
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.partial")
    try:
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            _write_all(descriptor, header)
            for view, nbytes in layout:
                _write_all(descriptor, view)
                _write_all(descriptor, bytes(_padded(nbytes, alignment) - nbytes))
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        if not overwrite and os.path.lexists(path):
            raise DestinationError(
                f"write_gguf: {path}: appeared while it was written; remove it or pass overwrite=True"
            )
        os.replace(temporary, path)
        _sync_folder(path.parent)
    except OSError as exc:
        raise DestinationError(f"write_gguf: {path}: cannot be written: {exc.strerror or exc}") from None
    finally:
        if os.path.lexists(temporary):
            os.unlink(temporary)
