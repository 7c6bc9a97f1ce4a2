"""Plain tensors (embeddings, norms, ``lm_head``, ignored layers) must hold finite values.

A quantized layer's scales are checked before it loads (``validate.check_values``); a plain
tensor is used as stored, so a NaN-filled ``lm_head`` would make every logit NaN with no error.
``load_checkpoint`` (and so ``qscheme run`` and ``apply_to_model``) refuses such a tensor, and
``inspect`` lists it. Float tensors (fp16, bf16, fp32, fp64) are checked in chunks of
``CHUNK_ELEMENTS`` values, so no check holds more than a chunk's mask beside the tensor; other
dtypes (integer buffers, fp8 codes) have no NaN to look for, or a meaning only their producer
knows, and are left alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from qscheme.errors import CheckpointError
from qscheme.storage import CheckpointFiles
from qscheme.tensor_checks import FLOAT_DTYPES, TensorProblem

CHUNK_ELEMENTS = 1 << 24  # 16M values: a 16 MiB mask per chunk

_FIX = (
    "the checkpoint was saved from a diverged or corrupted model: re-export it from a model whose weights are "
    "finite (or re-download the file)"
)


def nonfinite_problem(name: str, tensor: torch.Tensor, file: str) -> TensorProblem | None:
    """A TensorProblem naming how many values of ``tensor`` are NaN or infinite and where the first
    is, or None when all are finite (or its dtype is not a float one that can hold them)."""
    if str(tensor.dtype).removeprefix("torch.") not in FLOAT_DTYPES:
        return None
    flat = tensor.reshape(-1)
    bad, first, first_value = 0, -1, 0.0
    for start in range(0, flat.numel(), CHUNK_ELEMENTS):
        chunk = flat[start : start + CHUNK_ELEMENTS]
        mask = ~torch.isfinite(chunk)
        count = int(mask.sum())
        if count and first < 0:
            position = int(mask.nonzero()[0, 0])
            first, first_value = start + position, float(chunk[position])
        bad += count
    if not bad:
        return None
    index = list(_unravel(first, tuple(tensor.shape)))
    return TensorProblem(
        file,
        name,
        f"{bad:,} of its {flat.numel():,} {str(tensor.dtype).removeprefix('torch.')} values are NaN or infinite "
        f"(the first, {first_value}, at {index}); a plain tensor is used as stored, so every output it feeds would "
        f"be NaN: {_FIX}",
    )


def _unravel(flat_index: int, shape: tuple[int, ...]) -> Iterable[int]:
    position = []
    for size in reversed(shape):
        position.append(flat_index % size if size else 0)
        flat_index //= size if size else 1
    return reversed(position)


def plain_problems(files: CheckpointFiles, tensors: Mapping[str, torch.Tensor]) -> list[TensorProblem]:
    """The problems of plain tensors already read (``name -> tensor``; load reads them anyway)."""
    found = []
    for name, tensor in tensors.items():
        problem = nonfinite_problem(name, tensor, str(files.info(name).file))
        if problem is not None:
            found.append(problem)
    return found


def read_plain_problems(files: CheckpointFiles, names: Iterable[str]) -> list[str]:
    """``inspect``'s check: read each plain float tensor of ``names`` (one at a time, dropped after
    its check) and list what is wrong: non-finite values, or a tensor that cannot be read or
    allocated (a header claiming terabytes)."""
    problems: list[str] = []
    for name in names:
        info = files.info(name)
        if info.dtype not in FLOAT_DTYPES:
            continue
        try:
            tensor = files.get(name)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        problem = nonfinite_problem(name, tensor, str(info.file))
        del tensor
        if problem is not None:
            problems.append(str(problem))
    return problems
