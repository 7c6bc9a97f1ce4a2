"""Checkpoints for the checkpoint tests, written once per test session (see checkpoint_factory).

``ct_checkpoint(preset, ...)`` writes a compressed-tensors checkpoint with the library on first
use and returns its folder; later calls (from any test module) return the same folder. The
folders live in one temporary directory removed at exit. Tests must not modify them: copy
first (``copy_checkpoint``) to corrupt one.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from checkpoint_factory import write_ct_checkpoint

MODELOPT_FIXTURES = Path(__file__).parent / "fixtures" / "modelopt"
FUSE = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread: tiny matmuls on a busy 2-core machine are ~100x slower with two."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def single_threaded_torch() -> Iterator[None]:
    """Import into a test module to run its tests with torch on one thread."""
    with one_thread():
        yield


@functools.cache
def scratch_root() -> Path:
    """One temporary folder for the test session's generated checkpoints, removed at exit."""
    root = Path(tempfile.mkdtemp(prefix="qscheme-checkpoints-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


@functools.cache
def ct_checkpoint(
    preset: str,
    dtype: str = "float32",
    *,
    ignore: tuple[str, ...] = ("lm_head",),
    targets: tuple[str, ...] = ("Linear",),
    num_layers: int = 1,
    max_shard_size: str | None = None,
    attention_bias: bool = False,
) -> Path:
    """A compressed-tensors checkpoint written by the library (cached for the session)."""
    name = f"{preset}-{dtype}-{abs(hash((ignore, targets, num_layers, max_shard_size, attention_bias)))}"
    with one_thread():
        return write_ct_checkpoint(
            preset,
            scratch_root() / name,
            dtype=_DTYPES[dtype],
            ignore=ignore,
            targets=targets,
            num_layers=num_layers,
            max_shard_size=max_shard_size,
            attention_bias=attention_bias,
        )


def copy_checkpoint(source: Path, destination: Path) -> Path:
    """A writable copy of a checkpoint folder (for corruption tests)."""
    shutil.copytree(source, destination)
    return destination


def modelopt_fixture(name: str) -> Path:
    return MODELOPT_FIXTURES / name
