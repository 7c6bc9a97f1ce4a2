"""Plain tensors checked finite at load, by inspect and run; tensors too large to allocate are
typed errors naming the tensor and its bytes, and inspect lists them.

The checkpoints are a compressed-tensors W4A16 export (bf16 plain tensors: lm_head, embeddings,
norms) rewritten with NaN/inf values, or with a tensor whose header claims terabytes over a
sparse file.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
import torch
from checkpoint_cache import copy_checkpoint, ct_checkpoint
from safetensors.torch import load_file, save_file

import qscheme.storage.safetensors_reader as reader
from qscheme.checkpoint import load_checkpoint
from qscheme.checkpoint.inspect import inspect_checkpoint
from qscheme.checkpoint.plain import nonfinite_problem
from qscheme.cli.main import main
from qscheme.errors import CheckpointError
from qscheme.storage import DTYPE_BY_TORCH_NAME

HUGE_SHAPE = [1 << 21, 1 << 21]  # bf16: 8 TiB, a sparse file's worth
HUGE_BYTES = HUGE_SHAPE[0] * HUGE_SHAPE[1] * 2


def _export(tmp_path: Path) -> Path:
    return copy_checkpoint(ct_checkpoint("W4A16", "bfloat16"), tmp_path / "checkpoint")


def _rewrite(folder: Path, name: str, change: object) -> None:
    tensors = load_file(folder / "model.safetensors")
    tensor = tensors[name].clone()
    if callable(change):
        change(tensor)
    tensors[name] = tensor
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _poison(position: tuple[int, ...], value: float):  # type: ignore[no-untyped-def]
    def change(tensor: torch.Tensor) -> None:
        tensor[position] = value

    return change


@pytest.mark.parametrize(
    ("name", "position", "value", "shown"),
    [
        ("lm_head.weight", (3, 5), float("nan"), "nan"),
        ("model.norm.weight", (7,), float("inf"), "inf"),
        ("model.embed_tokens.weight", (0, 0), float("-inf"), "-inf"),
    ],
)
def test_a_nonfinite_plain_tensor_is_refused_by_load_and_listed_by_inspect(
    tmp_path: Path, name: str, position: tuple[int, ...], value: float, shown: str
) -> None:
    folder = _export(tmp_path)
    _rewrite(folder, name, _poison(position, value))
    first = re.escape(f"(the first, {shown}, at {list(position)})")
    message = rf"tensor '{name}': 1 of its [\d,]+ bfloat16 values are NaN or infinite {first}"
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(folder)
    inspection = inspect_checkpoint(folder)
    assert not inspection.ok
    assert any(name in problem and "NaN or infinite" in problem for problem in inspection.problems)


def test_a_nan_filled_lm_head_fails_inspect_and_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _export(tmp_path)
    _rewrite(folder, "lm_head.weight", lambda tensor: tensor.fill_(float("nan")))
    assert main(["inspect", str(folder)]) == 1
    out = capsys.readouterr().out
    assert "problems (1):" in out and "lm_head.weight" in out and "NaN or infinite" in out
    assert "problems: none" not in out
    assert main(["run", str(folder)]) == 1
    err = capsys.readouterr().err
    assert "lm_head.weight" in err and "32,768 of its 32,768 bfloat16 values are NaN or infinite" in err


def test_finite_plain_tensors_pass(tmp_path: Path) -> None:
    folder = ct_checkpoint("W4A16", "bfloat16")
    assert inspect_checkpoint(folder).ok
    assert len(load_checkpoint(folder).tensors) >= 3


def test_the_check_runs_in_chunks_and_finds_the_first_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    import qscheme.checkpoint.plain as plain

    monkeypatch.setattr(plain, "CHUNK_ELEMENTS", 7)
    tensor = torch.zeros(5, 11, dtype=torch.float16)
    tensor[3, 9] = float("inf")
    tensor[4, 0] = float("nan")
    problem = nonfinite_problem("w", tensor, "model.safetensors")
    assert problem is not None
    assert "2 of its 55 float16 values" in problem.message and "(the first, inf, at [3, 9])" in problem.message


def test_integer_and_fp8_tensors_are_not_checked() -> None:
    assert nonfinite_problem("ids", torch.arange(4), "f") is None
    codes = torch.full((4,), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)  # the e4m3fn NaN code
    assert nonfinite_problem("codes", codes, "f") is None


def _with_huge_tensor(folder: Path, name: str) -> None:
    """model.safetensors rewritten so that ``name`` claims HUGE_SHAPE bf16, its bytes a sparse hole."""
    tensors = load_file(folder / "model.safetensors")
    del tensors[name]
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    chunks, offset = [], 0
    for key, tensor in tensors.items():
        data = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        code = DTYPE_BY_TORCH_NAME[str(tensor.dtype).removeprefix("torch.")].code
        header[key] = {"dtype": code, "shape": list(tensor.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    header[name] = {"dtype": "BF16", "shape": HUGE_SHAPE, "data_offsets": [offset, offset + HUGE_BYTES]}
    raw = json.dumps(header).encode()
    path = folder / "model.safetensors"
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(raw)) + raw + b"".join(chunks))
        try:
            handle.truncate(8 + len(raw) + offset + HUGE_BYTES)
        except OSError as exc:
            pytest.skip(f"this file system holds no 8 TiB sparse file ({exc.strerror})")


@pytest.fixture
def huge_lm_head(tmp_path: Path) -> Path:
    if reader.memory_bytes() >= HUGE_BYTES:
        pytest.skip("this machine has 8 TiB of memory")
    folder = _export(tmp_path)
    _with_huge_tensor(folder, "lm_head.weight")
    return folder


def test_a_tensor_larger_than_memory_is_a_typed_error_naming_it_and_its_bytes(huge_lm_head: Path) -> None:
    with pytest.raises(
        CheckpointError,
        match=rf"tensor 'lm_head.weight' \(bfloat16 x \[2097152, 2097152\]\): reading it needs {HUGE_BYTES:,} bytes",
    ):
        load_checkpoint(huge_lm_head)


def test_inspect_lists_a_tensor_larger_than_memory(huge_lm_head: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(huge_lm_head)]) == 1
    out = capsys.readouterr().out
    assert "problems (1):" in out and f"reading it needs {HUGE_BYTES:,} bytes" in out


def test_an_allocation_the_allocator_refuses_is_a_typed_error(
    huge_lm_head: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Memory unknown (0), so the allocator is asked and refuses, as torch's does on Linux."""
    monkeypatch.setattr(reader, "memory_bytes", lambda: 0)
    real_empty = torch.empty

    def empty(*args: object, **kwargs: object) -> torch.Tensor:
        if args and isinstance(args[0], int) and args[0] >= HUGE_BYTES:
            raise RuntimeError(
                "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to "
                f"allocate {args[0]} bytes. Error code 12 (Cannot allocate memory)"
            )
        return real_empty(*args, **kwargs)  # type: ignore[call-overload, no-any-return]

    monkeypatch.setattr(reader.torch, "empty", empty)
    message = (
        rf"tensor 'lm_head.weight' \(bfloat16 x \[2097152, 2097152\]\): {HUGE_BYTES:,} bytes could not be allocated"
    )
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(huge_lm_head)
    assert main(["inspect", str(huge_lm_head)]) == 1
    assert "could not be allocated" in capsys.readouterr().out


def test_a_tensor_parallel_rank_checks_plain_tensors_too(tmp_path: Path) -> None:
    folder = _export(tmp_path)
    _rewrite(folder, "lm_head.weight", _poison((1, 2), float("nan")))
    with pytest.raises(CheckpointError, match=r"on rank 0, nothing was loaded:\n.*'lm_head.weight': 1 of its"):
        load_checkpoint(folder, tp_rank=0, tp_size=1)  # the rank loader, one rank


def test_a_tensor_parallel_rank_refuses_a_tensor_larger_than_memory(huge_lm_head: Path) -> None:
    with pytest.raises(CheckpointError, match=rf"'lm_head.weight' .*reading it needs {HUGE_BYTES:,} bytes"):
        load_checkpoint(huge_lm_head, tp_rank=0, tp_size=1)
