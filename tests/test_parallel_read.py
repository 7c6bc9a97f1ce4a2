"""read_slice reads exactly the slice safetensors' own get_slice returns, and only its bytes.

The bytes test loads every rank of a 2- and 4-way split and checks that each rank reads about
1/n of each split layer's stored bytes (replicated scalars add a few bytes).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from parallel_checkpoints import write_checkpoint
from safetensors import safe_open
from safetensors.torch import save_file

from qscheme.errors import CheckpointError
from qscheme.parallel import ReadCounter, load_checkpoint_tp, read_slice
from qscheme.storage import CheckpointFiles


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("read")
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "matrix": torch.randn(12, 20, generator=generator),
        "bytes": torch.randint(0, 255, (8, 6), generator=generator, dtype=torch.uint8),
        "blocks": torch.randn(4, 1, 6, 1, generator=generator),
        "vector": torch.randn(10, generator=generator).to(torch.bfloat16),
        "scalar": torch.tensor(3.5),
    }
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize(
    ("name", "index"),
    [
        ("matrix", (slice(3, 9), slice(0, 20))),
        ("matrix", (slice(0, 12), slice(5, 15))),
        ("bytes", (slice(0, 8), slice(2, 4))),
        ("blocks", (slice(0, 4), slice(0, 1), slice(3, 6), slice(0, 1))),
        ("blocks", (slice(2, 4), slice(0, 1), slice(0, 6), slice(0, 1))),
        ("vector", (slice(5, 10),)),
        ("scalar", ()),
    ],
)
def test_a_slice_equals_safetensors_get_slice(stored: Path, name: str, index: tuple[slice, ...]) -> None:
    info = CheckpointFiles(stored).info(name)
    counter = ReadCounter()
    got = read_slice(info, index, counter)
    with safe_open(str(stored / "model.safetensors"), "pt") as handle:
        expected = handle.get_slice(name)[index] if index else handle.get_tensor(name)
    assert got.dtype == expected.dtype and torch.equal(got, expected)
    assert counter.total == got.numel() * got.element_size()  # only the slice's bytes


def test_two_partial_dimensions_and_out_of_range_slices_are_refused(stored: Path) -> None:
    info = CheckpointFiles(stored).info("matrix")
    with pytest.raises(CheckpointError, match="one dimension"):
        read_slice(info, (slice(0, 6), slice(0, 10)))
    with pytest.raises(CheckpointError, match="outside its 12 elements"):
        read_slice(info, (slice(6, 18), slice(0, 20)))


def test_a_file_truncated_after_its_header_was_read(stored: Path, tmp_path: Path) -> None:
    copy = tmp_path / "model.safetensors"
    copy.write_bytes((stored / "model.safetensors").read_bytes())
    info = CheckpointFiles(tmp_path).info("matrix")
    with copy.open("r+b") as handle:
        handle.truncate(info.offset + 40)
    with pytest.raises(CheckpointError, match="truncated"):
        read_slice(info, (slice(6, 12), slice(0, 20)))


@pytest.mark.parametrize(
    ("scheme", "degrees"), [("compressed-tensors/NVFP4", (2, 4)), ("compressed-tensors/W4A16_ASYM", (2,))]
)
def test_each_rank_reads_about_one_nth_of_each_split_layer(
    scheme: str, degrees: tuple[int, ...], tmp_path: Path
) -> None:
    folder = write_checkpoint(tmp_path / "ck", scheme)
    files = CheckpointFiles(folder)
    for tp_size in degrees:
        for rank in range(tp_size):
            shard = load_checkpoint_tp(folder, rank, tp_size)
            for name, layer in shard.shards.items():
                if layer.style == "replicate":
                    continue
                prefix = name + "."
                whole = sum(files.info(t).nbytes for t in files.tensors if t.startswith(prefix))
                read = sum(count for t, count in shard.bytes_read.by_tensor.items() if t.startswith(prefix))
                # replicated scalars are read whole; weight_shape is written, not read
                assert abs(read - whole / tp_size) <= 64, (name, read, whole)
