"""qscheme.storage.safetensors_header at scale: a million-tensor header is read in seconds (work counted).

The header's integers are read by json's C parser, the garbage collector is paused while its
objects are built, and the per-tensor checks work out the file's shown name once. Work is
counted here (Python calls per tensor), not timed; benchmarks/header_speed.py times it.
"""

from __future__ import annotations

import gc
import json
import struct
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_checkpoint_fuzz import FUZZ, _example, _split, _write_safetensors, damaged_header

import qscheme.storage.safetensors_header as header_module
from qscheme.errors import CheckpointError
from qscheme.storage import read_file_header


def write_many(path: Path, count: int, extra: dict[str, object] | None = None, prefix: str = "model.layers") -> Path:
    """A safetensors file of ``count`` one-byte U8 tensors."""
    header: dict[str, object] = {
        f"{prefix}.{index}.mlp.weight": {"dtype": "U8", "shape": [1], "data_offsets": [index, index + 1]}
        for index in range(count)
    }
    if extra:
        first = header[f"{prefix}.0.mlp.weight"]
        assert isinstance(first, dict)
        first.update(extra)
    raw = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(count))
    return path


@contextmanager
def python_calls() -> Iterator[list[int]]:
    """Counts calls of Python functions (not C ones) made inside the block."""
    counter = [0]

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            counter[0] += 1

    sys.setprofile(profile)
    try:
        yield counter
    finally:
        sys.setprofile(None)


def calls_per_tensor(tmp_path: Path, count: int) -> float:
    path = write_many(tmp_path / f"many-{count}.safetensors", count)
    with python_calls() as calls:
        header = read_file_header(path)
    assert len(header.tensors) == count
    return calls[0] / count


def test_work_per_tensor_is_small_and_does_not_grow(tmp_path: Path) -> None:
    """A few Python calls per tensor (the entry's dict, its checks, its TensorInfo), the same at
    5,000 and 50,000 tensors. Before: ~20 a tensor (a hook call per integer, the file's shown
    name twice, a generator per list), which made a million-tensor header take about a minute."""
    small = calls_per_tensor(tmp_path, 5_000)
    large = calls_per_tensor(tmp_path, 50_000)
    assert large <= 8, large
    assert large <= small * 1.05 + 0.1, (small, large)


def test_the_collector_is_restored_after_a_header(tmp_path: Path) -> None:
    path = write_many(tmp_path / "a.safetensors", 10)
    read_file_header(path)
    assert gc.isenabled()
    gc.disable()
    try:
        read_file_header(path)
        assert not gc.isenabled()  # a caller's choice is kept
    finally:
        gc.enable()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", 2) + b"{]")
    with pytest.raises(CheckpointError):
        read_file_header(bad)
    assert gc.isenabled()


def test_a_name_holding_minus_zero_is_read_the_strict_way_and_accepted(tmp_path: Path) -> None:
    path = write_many(tmp_path / "a.safetensors", 3, prefix="block-0")
    assert len(read_file_header(path).tensors) == 3


def test_minus_zero_as_a_size_is_refused(tmp_path: Path) -> None:
    raw = b'{"a":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}}'
    path = tmp_path / "a.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(CheckpointError, match=r"shape \[-0.0\] is not a list of sizes"):
        read_file_header(path)


@pytest.mark.parametrize("digits", [21, 30, 5000])
def test_an_integer_longer_than_any_size_in_an_extra_field_gets_the_strict_message(tmp_path: Path, digits: int) -> None:
    """The C parser reads it; the check after it notices, and the strict reading names it."""
    path = write_many(tmp_path / "a.safetensors", 3)
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    text = raw[8 : 8 + length].replace(b'"dtype"', b'"x":' + b"9" * digits + b',"dtype"', 1)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])
    with pytest.raises(CheckpointError, match=rf"not valid JSON: an integer of {digits} digits"):
        read_file_header(path)


def _outcome(path: Path) -> object:
    """What read_file_header gives: the tensors and metadata, or the error's message."""
    try:
        header = read_file_header(path)
    except CheckpointError as exc:
        return str(exc)
    return header.tensors, header.metadata


@settings(FUZZ, max_examples=150)
@given(st.data())
def test_reading_integers_in_c_gives_what_strict_reading_gives(data: st.DataObject) -> None:
    """Over the fuzz test's damaged headers (huge integers, -0, booleans, floats, duplicate keys,
    byte damage...): the same tensors, or the same message, as reading every integer through the
    strict hook."""
    header, tensor_data = _split(_example("ct") / "model.safetensors")
    text, prefix = data.draw(damaged_header(header))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model.safetensors"
        _write_safetensors(path, text, prefix, tensor_data)
        fast = _outcome(path)
        with mock.patch.object(header_module, "_FAST_INT_DIGITS", 0):  # every header read strictly
            strict = _outcome(path)
    assert fast == strict
