"""bytes_copy: spans of a source file written by the kernel, compared back byte for byte; mapped views."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import qscheme.storage.bytes_copy as bytes_copy
from qscheme.errors import CheckpointError, OutputError
from qscheme.storage import MappedShard, RawSpan, first_difference, read_file_header, write_shard
from qscheme.writing.verify import verify_folder, verify_shard


def _source(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "embed.weight": torch.randn(300, 70, generator=generator).to(torch.bfloat16),
        "layer.weight_packed": torch.randint(0, 256, (64, 48), dtype=torch.uint8, generator=generator),
        "layer.weight_scale": torch.rand(64, 6, generator=generator).to(torch.float8_e4m3fn),
        "norm.weight": torch.ones(70),
    }
    path = tmp_path / "src" / "model.safetensors"
    path.parent.mkdir()
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path, tensors


def test_spans_and_tensors_write_as_save_file_would_and_verify(tmp_path: Path) -> None:
    path, tensors = _source(tmp_path)
    before = path.read_bytes()
    mapped = MappedShard(path, read_file_header(path))
    out = {
        "embed.weight": mapped.span("embed.weight"),
        "layer.weight": mapped.span("layer.weight_packed", "U8", (32, 96)),  # renamed and reshaped, same bytes
        "layer.weight_scale": mapped.tensor("layer.weight_scale").to(torch.float32),  # computed: a CRC-32
        "norm.weight": mapped.span("norm.weight"),
    }
    record = write_shard(tmp_path / "out.safetensors", out)
    assert [t.same_as is not None for t in record.tensors] == [True, True, False, True]
    back = load_file(str(record.path))
    assert torch.equal(back["embed.weight"], tensors["embed.weight"])
    assert torch.equal(back["layer.weight"], tensors["layer.weight_packed"].reshape(32, 96))
    assert torch.equal(back["layer.weight_scale"], tensors["layer.weight_scale"].to(torch.float32))
    assert torch.equal(back["norm.weight"], tensors["norm.weight"])
    assert verify_shard(record) == record.data_bytes
    assert verify_folder(tmp_path, [record]) == record.data_bytes
    mapped.close()
    assert path.read_bytes() == before  # the source is never written


def test_a_copied_span_that_differs_from_its_source_is_refused(tmp_path: Path) -> None:
    path, _ = _source(tmp_path)
    mapped = MappedShard(path, read_file_header(path))
    record = write_shard(tmp_path / "out.safetensors", {"embed.weight": mapped.span("embed.weight")})
    data = bytearray(record.path.read_bytes())
    data[-7] ^= 0x10
    record.path.write_bytes(bytes(data))
    with pytest.raises(OutputError, match=r"'embed\.weight' reads back with other bytes than its source"):
        verify_shard(record)


def test_the_copy_falls_back_to_reads_and_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, tensors = _source(tmp_path)

    def unsupported(*args: object) -> int:
        raise OSError(18, "Invalid cross-device link")  # EXDEV

    mapped = MappedShard(path, read_file_header(path))
    for replacement in (unsupported, None):  # refused by the file system; absent (not Linux)
        if replacement is None:
            monkeypatch.delattr(bytes_copy.os, "copy_file_range", raising=False)
        else:
            monkeypatch.setattr(bytes_copy.os, "copy_file_range", replacement, raising=False)
        record = write_shard(tmp_path / "out.safetensors", {"embed.weight": mapped.span("embed.weight")})
        assert torch.equal(load_file(str(record.path))["embed.weight"], tensors["embed.weight"])
        verify_shard(record)


def test_a_truncated_source_is_an_error_not_short_data(tmp_path: Path) -> None:
    path, _ = _source(tmp_path)
    header = read_file_header(path)
    span = RawSpan(path, header.tensors["embed.weight"].offset, header.size, "BF16", (1,))
    with pytest.raises(OutputError, match="ends inside"):
        write_shard(tmp_path / "out.safetensors", {"x": span})


def test_mapped_tensors_view_the_file_and_a_changed_file_is_refused(tmp_path: Path) -> None:
    path, tensors = _source(tmp_path)
    header = read_file_header(path)
    mapped = MappedShard(path, header)
    for name, value in tensors.items():
        view = mapped.tensor(name)
        assert view.dtype == value.dtype and torch.equal(view.view(torch.uint8), value.view(torch.uint8))
    with path.open("ab") as handle:
        handle.write(b"\0" * 8)
    with pytest.raises(CheckpointError, match="changed since its header was checked"):
        MappedShard(path, header)


def test_first_difference_finds_the_byte(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    data = os.urandom(3 * bytes_copy.CHUNK + 12345)
    a.write_bytes(b"xx" + data)
    b.write_bytes(b"yyyyy" + data)
    assert first_difference(a, 2, b, 5, len(data)) is None
    changed = bytearray(data)
    changed[2 * bytes_copy.CHUNK + 77] ^= 1
    b.write_bytes(b"yyyyy" + bytes(changed))
    assert first_difference(a, 2, b, 5, len(data)) == 2 * bytes_copy.CHUNK + 77
    assert first_difference(a, 2, b, 5, 0) is None
