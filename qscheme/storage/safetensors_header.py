"""One safetensors file's header, parsed and checked at least as strictly as safetensors' own reader.

A header qscheme accepts is one the safetensors Rust reader (0.8) accepts too, so a checkpoint
that loads here loads in every other tool; and a hostile header gets a CheckpointError naming
the file (and the tensor), never a traceback, a hang or a giant allocation. File names, which
the checkpoint chooses, are shown escaped (``shown_file``). Checked, in order:

- the 8-byte length field: at most ``MAX_HEADER_BYTES`` (safetensors' own cap) and inside the file;
- the JSON: UTF-8, an object, no key twice, no NaN/Infinity, no number beyond a 64-bit float
  (``1e999``) anywhere, no integer longer than any size can be, nesting at most ``MAX_NESTING``
  deep, no lone UTF-16 surrogate in any string;
- ``__metadata__``: absent, null, or an object of text -> text;
- each tensor: a dtype code safetensors writes and torch can hold, a shape and ``data_offsets``
  of non-negative integers below 2**64 (booleans, floats and ``-0``, a float to safetensors, are
  not sizes); a shape whose sizes, multiplied in order, never pass 2**64-1 (safetensors' check,
  which a later 0 does not undo), none above torch's 2**63-1, and that torch can build even with
  no element; a byte count that is dtype bits x elements / 8 with no part-byte left over (4- and
  6-bit dtypes);
- the data section: the tensors cover it exactly, from byte 0 to the end of the file, with no
  overlap, no gap and no trailing bytes.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import math
import os
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qscheme.errors import CheckpointError
from qscheme.text import shown, shown_file

MAX_HEADER_BYTES = 100_000_000  # safetensors refuses a longer header ("header too large")
MAX_NESTING = 64  # safetensors' JSON parser stops near 128 levels; a real header needs 3
MAX_SIZE = 2**64 - 1  # shapes and offsets are u64 in safetensors
MAX_TORCH_SIZE = 2**63 - 1  # torch holds each dimension, and the element count, in an int64
_MAX_DIGITS = len(str(MAX_SIZE))
# json's C parser reads integers with int(), bounded by Python's int_max_str_digits (4300 by
# default); above this bound (or unbounded, 0) every integer goes through _parse_int instead.
_FAST_INT_DIGITS = 10_000
_FIX = "re-save or re-download the file"


@dataclass(frozen=True)
class Dtype:
    """A safetensors dtype code: its width in bits and the torch dtype that holds it (if any)."""

    code: str
    bits: int
    torch_name: str | None

    @property
    def torch_dtype(self) -> torch.dtype | None:
        dtype = getattr(torch, self.torch_name, None) if self.torch_name else None
        return dtype if isinstance(dtype, torch.dtype) else None


# Every code the safetensors 0.8 reader knows, in its own order. F4 is held two per byte along
# the last dimension (torch.float4_e2m1fn_x2); torch has no 6-bit dtype.
SAFETENSORS_DTYPES: dict[str, Dtype] = {
    code: Dtype(code, bits, torch_name)
    for code, bits, torch_name in (
        ("BOOL", 8, "bool"),
        ("F4", 4, "float4_e2m1fn_x2"),
        ("F6_E2M3", 6, None),
        ("F6_E3M2", 6, None),
        ("U8", 8, "uint8"),
        ("I8", 8, "int8"),
        ("F8_E5M2", 8, "float8_e5m2"),
        ("F8_E4M3", 8, "float8_e4m3fn"),
        ("F8_E8M0", 8, "float8_e8m0fnu"),
        ("F8_E4M3FNUZ", 8, "float8_e4m3fnuz"),
        ("F8_E5M2FNUZ", 8, "float8_e5m2fnuz"),
        ("I16", 16, "int16"),
        ("U16", 16, "uint16"),
        ("F16", 16, "float16"),
        ("BF16", 16, "bfloat16"),
        ("I32", 32, "int32"),
        ("U32", 32, "uint32"),
        ("F32", 32, "float32"),
        ("C64", 64, "complex64"),
        ("F64", 64, "float64"),
        ("I64", 64, "int64"),
        ("U64", 64, "uint64"),
    )
}
DTYPE_BY_TORCH_NAME: dict[str, Dtype] = {d.torch_name: d for d in SAFETENSORS_DTYPES.values() if d.torch_name}
_TORCH_DTYPES: dict[str, torch.dtype | None] = {code: d.torch_dtype for code, d in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's header entry: its dtype (torch name), shape, the file holding it and where.

    ``shape`` is the header's, in elements (an F4 tensor [N, K] is K/2 bytes a row);
    ``offset`` is the first byte of its data in ``file``.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    offset: int = 0

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BY_TORCH_NAME[self.dtype].bits // 8


@dataclass(frozen=True)
class FileHeader:
    """One file's checked header, and the file's identity when it was read (to notice a rewrite)."""

    path: Path
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] | None
    size: int
    identity: tuple[int, int, int]  # (device, inode, mtime in ns)


class _HeaderError(ValueError):
    """A problem found inside json.loads (its hooks), turned into a CheckpointError by the caller."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) == len(pairs):
        return result  # the usual case, a million tensors included: no loop in Python
    result = {}
    for key, value in pairs:
        if key in result:
            raise _HeaderError(
                f"key {key!r} appears more than once in one object (a tensor or field listed twice; "
                "safetensors keeps one of them silently)"
            )
        result[key] = value
    return result


def _parse_int(text: str) -> int | float:
    if len(text.lstrip("-")) > _MAX_DIGITS:
        raise _HeaderError(f"an integer of {len(text)} digits ({text[:12]}...), longer than any size (below 2**64)")
    value = int(text)
    # safetensors' JSON parser reads -0 as the float -0.0, which is not a size
    return -0.0 if value == 0 and text.startswith("-") else value


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a header's millions of small objects are built
    (none of them is a cycle): each collection would walk all of them again, which made a
    million-tensor header take twice as long."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _parse_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _HeaderError(
            f"the number {_short(text)} is out of range of a 64-bit float (safetensors refuses it: "
            "'number out of range')"
        )
    return value


def _refuse_constant(text: str) -> Any:
    raise _HeaderError(f"{text} is not JSON (safetensors refuses it)")


def _walk(value: object, depth: int) -> Iterator[tuple[object, int]]:
    """Every value nested in ``value``, with its depth, without recursion."""
    stack = [(value, depth)]
    while stack:
        item, level = stack.pop()
        yield item, level
        if isinstance(item, dict):
            stack.extend((v, level + 1) for v in itertools.chain(item.keys(), item.values()))
        elif isinstance(item, list):
            stack.extend((v, level + 1) for v in item)


def _bad_text(text: str) -> bool:
    """A lone surrogate (from a ``\\ud800`` escape) is not UTF-8: safetensors refuses it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _check_text(path: Path, where: str, text: str) -> None:
    if _bad_text(text):
        raise CheckpointError(
            f"{shown_file(path)}: {where}: text {_short(text)} holds a lone UTF-16 surrogate, which is not UTF-8 "
            f"(safetensors refuses it): {_FIX}"
        )


def _check_nested(path: Path, where: str, value: object, depth: int) -> None:
    for item, level in _walk(value, depth):
        if level > MAX_NESTING:
            raise CheckpointError(
                f"{shown_file(path)}: {where}: JSON nested more than {MAX_NESTING} levels deep; a safetensors header "
                f"needs 3 (not a safetensors file, or a hostile one): {_FIX}"
            )
        if isinstance(item, str):
            _check_text(path, where, item)


def _load_json(path: Path, raw: bytes, strict: bool = True) -> dict[str, Any]:
    """The header's JSON object. ``strict`` reads every integer through ``_parse_int`` (a Python
    call each); without it json's C parser reads them, which a caller may use only where the text
    holds no ``-0`` and where it reads the header again strictly on any error (``read_file_header``)."""
    file = shown_file(path)
    try:
        text = raw.decode("utf-8")
        header = json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_int=_parse_int if strict else int,
            parse_float=_parse_float,
            parse_constant=_refuse_constant,
        )
    except UnicodeDecodeError as exc:
        raise CheckpointError(
            f"{file}: the safetensors header is not UTF-8 text ({exc.reason} at byte {exc.start}): {_FIX}"
        ) from None
    except RecursionError:
        raise CheckpointError(
            f"{file}: the safetensors header nests JSON too deep to parse; a safetensors header needs 3 levels: {_FIX}"
        ) from None
    except ValueError as exc:  # JSONDecodeError, the hooks' _HeaderError, int() of a huge number
        raise CheckpointError(f"{file}: the safetensors header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError(
            f"{file}: the safetensors header is a JSON {_json_type(header)}, not an object of tensor name -> "
            f"entry: {_FIX}"
        )
    return header


def _metadata(path: Path, value: object) -> dict[str, str] | None:
    file = shown_file(path)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise CheckpointError(
            f"{file}: __metadata__ is a {_json_type(value)}; safetensors allows only an object of text keys -> "
            f'text values (e.g. {{"format": "pt"}}): {_FIX}'
        )
    for key, item in value.items():
        if not isinstance(item, str):
            raise CheckpointError(
                f"{file}: __metadata__[{key!r}] is a {_json_type(item)} ({_short(item)}); safetensors allows only "
                f"text values there: {_FIX}"
            )
        _check_text(path, "__metadata__", key)
        _check_text(path, f"__metadata__[{key!r}]", item)
    return value


def _json_type(value: object) -> str:
    names = {bool: "true/false", int: "number", float: "number", str: "text", list: "list", dict: "object"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _sizes(value: object, count: int | None) -> bool:
    """A list of ``count`` (any when None) integers in [0, 2**64); booleans are not sizes."""
    if type(value) is not list or (count is not None and len(value) != count):
        return False
    for item in value:  # a plain loop: a header can hold millions of these short lists
        if type(item) is not int or item < 0 or item > MAX_SIZE:
            return False
    return True


def _check_shape(file: str, where: str, shape: list[int], torch_dtype: torch.dtype, bits: int) -> int:
    """A shape safetensors can size and torch can hold, zero-element shapes included; its element
    count. ``file`` is the file as messages show it (``shown_file``)."""
    count = 1
    for size in shape:
        # safetensors multiplies the sizes in order and refuses any overflow, even one a later 0 would undo
        count *= size
        if count > MAX_SIZE:
            raise CheckpointError(
                f"{file}: {where}: shape {_short(shape)}: the product of its sizes, taken in order, "
                f"passes 2**64-1 (safetensors refuses it: 'overflow computing buffer size'); every partial "
                f"product must stay below 2**64: {_FIX}"
            )
    big = [size for size in shape if size > MAX_TORCH_SIZE] if shape and max(shape) > MAX_TORCH_SIZE else []
    if big:
        raise CheckpointError(
            f"{file}: {where}: shape {_short(shape)} has size {big[0]}, more than torch's largest "
            f"dimension 2**63-1: {_FIX}"
        )
    if count or not shape:
        return count  # the data check bounds every size by the file's length, so torch holds the tensor
    sizes = [*shape[:-1], shape[-1] // 2] if bits == 4 else shape
    try:
        torch.empty(0, dtype=torch.uint8).view(torch_dtype).reshape(sizes)  # no element: nothing allocated
    except (RuntimeError, TypeError, ValueError, OverflowError) as exc:
        raise CheckpointError(
            f"{file}: {where}: torch cannot hold an empty tensor of shape {_short(shape)} ({shown(exc, 120)}): {_FIX}"
        ) from None
    return count


_ENTRY_KEYS = ("dtype", "shape", "data_offsets")


def _tensor(
    path: Path, file: str, name: str, entry: object, data_start: int, data_size: int, escapes: bool = True
) -> tuple[TensorInfo, int]:
    """(TensorInfo, end offset in the data section) of one checked header entry; ``file`` is
    ``shown_file(path)``, worked out once per file (a header can list a million tensors);
    ``escapes``: whether the header holds a ``\\u`` escape, without which no name can hold a lone
    surrogate."""
    if escapes:
        _check_text(path, "a tensor name", name)
    if not isinstance(entry, dict):
        raise CheckpointError(
            f"{file}: tensor {name!r}: header entry is a {_json_type(entry)}, not an object with dtype, shape and "
            f"data_offsets: {_FIX}"
        )
    missing = [key for key in _ENTRY_KEYS if key not in entry]
    if missing:
        raise CheckpointError(f"{file}: tensor {name!r}: header entry lacks {', '.join(missing)}: {_FIX}")
    if len(entry) > len(_ENTRY_KEYS):
        _check_nested(
            path, f"tensor {name!r}", {key: value for key, value in entry.items() if key not in _ENTRY_KEYS}, 2
        )
    code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    dtype = SAFETENSORS_DTYPES.get(code) if isinstance(code, str) else None
    if dtype is None:
        raise CheckpointError(
            f"{file}: tensor {name!r}: unknown dtype {_short(code)}; safetensors writes {', '.join(SAFETENSORS_DTYPES)}"
        )
    torch_dtype = _TORCH_DTYPES[dtype.code]
    if torch_dtype is None:
        readable = [d.code for d in SAFETENSORS_DTYPES.values() if d.torch_dtype is not None]
        raise CheckpointError(
            f"{file}: tensor {name!r}: dtype {code} has no torch dtype in torch {torch.__version__}, so qscheme "
            f"cannot read it; readable: {', '.join(readable)}"
        )
    if not _sizes(shape, None):
        raise CheckpointError(
            f"{file}: tensor {name!r}: shape {_short(shape)} is not a list of sizes (integers from 0 to 2**64-1; "
            f"true/false, decimals and -0 are not sizes): {_FIX}"
        )
    if not _sizes(offsets, 2):
        raise CheckpointError(
            f"{file}: tensor {name!r}: data_offsets {_short(offsets)} is not [begin, end], two integers from 0 to "
            f"2**64-1 (-0 and decimals are not integers): {_FIX}"
        )
    numel = _check_shape(file, f"tensor {name!r}", shape, torch_dtype, dtype.bits)
    begin, end = offsets
    info = TensorInfo(name=name, dtype=dtype.torch_name or "", shape=tuple(shape), file=path, offset=data_start + begin)
    bits = numel * dtype.bits
    if bits > MAX_SIZE:
        raise CheckpointError(f"{file}: tensor {name!r}: {code} x {list(shape)} is more than 2**64 bits: {_FIX}")
    if bits % 8:
        multiple = 8 // math.gcd(dtype.bits, 8)
        raise CheckpointError(
            f"{file}: tensor {name!r}: {code} x {list(shape)} is {numel} values of {dtype.bits} bits, which does not "
            f"end on a byte ({bits} bits); a {dtype.bits}-bit tensor needs a multiple of {multiple} "
            f"values: {_FIX}"
        )
    if dtype.bits == 4 and (not shape or shape[-1] % 2):
        raise CheckpointError(
            f"{file}: tensor {name!r}: F4 x {list(shape)}: torch holds two FP4 values per byte along the last "
            f"dimension, so it must be even: {_FIX}"
        )
    if not begin <= end:
        raise CheckpointError(f"{file}: tensor {name!r}: data_offsets [{begin}, {end}] are not increasing: {_FIX}")
    if end - begin != bits // 8:
        raise CheckpointError(
            f"{file}: tensor {name!r}: header says {end - begin} bytes (offsets [{begin}, {end}]) but "
            f"{code} x {list(shape)} needs {bits // 8}"
        )
    if end > data_size:
        raise CheckpointError(
            f"{file}: tensor {name!r}: data ends at byte {end} of the data section but the file holds only "
            f"{data_size} bytes there (file truncated, or the header lies about offsets)"
        )
    return info, end


def _check_coverage(path: Path, spans: list[tuple[int, int, str]], data_size: int) -> None:
    """The tensors tile the data section: sorted by offsets, each starts where the previous ends.

    Overlaps are looked for first: one tensor moved onto another also leaves a gap, but the
    overlap says better what is wrong.
    """
    file = shown_file(path)
    spans.sort()
    for (_, end, first), (begin, _, second) in itertools.pairwise(spans):
        if begin < end:
            raise CheckpointError(
                f"{file}: tensors {first!r} and {second!r} overlap in the data section (bad offsets): {_FIX}"
            )
    expected, previous = 0, None
    for begin, end, name in spans:
        if begin > expected:
            after = f"after tensor {previous!r}" if previous is not None else "at its start"
            raise CheckpointError(
                f"{file}: bytes {expected}-{begin} of the data section, {after}, belong to no tensor (a gap, which "
                f"safetensors refuses: the header lies about offsets, or a tensor was dropped): {_FIX}"
            )
        expected, previous = end, name
    if expected != data_size:
        last = f"the last tensor, {previous!r}, ends" if previous is not None else "no tensor holds data; it ends"
        raise CheckpointError(
            f"{file}: {last} at byte {expected} of the data section but the file has {data_size - expected} more "
            f"bytes after it (trailing bytes, which safetensors refuses): {_FIX}"
        )


def read_file_header(path: Path) -> FileHeader:
    """Parse and check one safetensors file's header; CheckpointError naming the file and tensor."""
    file = shown_file(path)
    try:
        with path.open("rb") as handle:
            stat = os.fstat(handle.fileno())
            file_size = stat.st_size
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{file}: truncated: {file_size} bytes, shorter than the 8-byte header length")
            (header_size,) = struct.unpack("<Q", prefix)
            if header_size > MAX_HEADER_BYTES:
                raise CheckpointError(
                    f"{file}: header length field says {header_size:,} bytes, more than the {MAX_HEADER_BYTES:,} "
                    "safetensors accepts (not a safetensors file, or a corrupt one): " + _FIX
                )
            if header_size > file_size - 8:
                raise CheckpointError(
                    f"{file}: header length field says {header_size} bytes but the file has {file_size - 8} "
                    "after it (truncated or not a safetensors file)"
                )
            raw = handle.read(header_size)
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot be read: {exc.strerror}") from None
    if len(raw) < header_size:
        raise CheckpointError(f"{file}: shrank while its header was read; is another program writing it?")
    data_start = 8 + header_size
    with _collector_paused():
        # Integers read by json's C parser first (a million-tensor header in seconds): a -0 needs
        # _parse_int to tell it from 0, and an integer longer than any size (which _parse_int
        # refuses) fails a later check, so any error reads the header again strictly, for the
        # message strict reading gives.
        if b"-0" not in raw and 0 < sys.get_int_max_str_digits() <= _FAST_INT_DIGITS:
            try:
                tensors, metadata = _checked(path, file, raw, data_start, file_size - data_start, strict=False)
            except CheckpointError:
                pass
            else:
                return FileHeader(path, tensors, metadata, file_size, (stat.st_dev, stat.st_ino, stat.st_mtime_ns))
        tensors, metadata = _checked(path, file, raw, data_start, file_size - data_start, strict=True)
    return FileHeader(path, tensors, metadata, file_size, (stat.st_dev, stat.st_ino, stat.st_mtime_ns))


def _checked(
    path: Path, file: str, raw: bytes, data_start: int, data_size: int, strict: bool
) -> tuple[dict[str, TensorInfo], dict[str, str] | None]:
    """The checked tensors and metadata of one header (``raw``); ``strict``: see ``_load_json``."""
    header = _load_json(path, raw, strict)
    metadata = _metadata(path, header.get("__metadata__"))
    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    escapes = b"\\u" in raw
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        info, end = _tensor(path, file, name, entry, data_start, data_size, escapes)
        tensors[name] = info
        spans.append((info.offset - data_start, end, name))
    _check_coverage(path, spans, data_size)
    if not strict:
        _refuse_long_integers(path, header)
    return tensors, metadata


def _refuse_long_integers(path: Path, header: dict[str, Any]) -> None:
    """An integer ``_parse_int`` would have refused, in a field no other check reads (an entry's
    extra keys): a CheckpointError, so that the caller reads the header again strictly."""
    for name, entry in header.items():
        if name != "__metadata__" and len(entry) > len(_ENTRY_KEYS):
            for item, _ in _walk(entry, 1):
                if type(item) is int and abs(item) >= 10**_MAX_DIGITS:
                    raise CheckpointError(f"{shown_file(path)}: tensor {name!r}: an integer longer than any size")


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The checked tensors of one safetensors file, by name (see ``read_file_header``)."""
    return read_file_header(path).tensors
