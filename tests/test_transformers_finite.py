"""``from_pretrained`` refuses plain tensors (lm_head, norms, embeddings) holding NaN or infinity.

On this route transformers loads the plain tensors, not qscheme's loader, so the check runs on the
loaded model (qscheme/transformers/_finite.py). The checkpoint is the shipped ModelOpt NVFP4
export, copied and rewritten with one poisoned value.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from checkpoint_cache import modelopt_fixture
from safetensors.torch import load_file, save_file

import qscheme.transformers  # noqa: F401  (registers the quantizers)
from qscheme.errors import CheckpointError
from qscheme.modules import QuantLinear


def _copy_with(tmp_path: Path, name: str, position: tuple[int, ...], value: float) -> Path:
    folder = tmp_path / "nvfp4"
    shutil.copytree(modelopt_fixture("nvfp4"), folder)
    tensors = load_file(folder / "model.safetensors")
    tensor = tensors[name].clone()
    tensor[position] = value
    tensors[name] = tensor
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _load(folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder)


@pytest.mark.parametrize(
    ("name", "position", "value"),
    [
        ("lm_head.weight", (2, 3), float("nan")),
        ("model.norm.weight", (1,), float("inf")),
        ("model.layers.0.input_layernorm.weight", (0,), float("-inf")),
    ],
)
def test_from_pretrained_refuses_a_nonfinite_plain_tensor(
    tmp_path: Path, name: str, position: tuple[int, ...], value: float
) -> None:
    folder = _copy_with(tmp_path, name, position, value)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}': 1 of its [\d,]+ \w+ values are NaN or infinite"):
        _load(folder)


def test_from_pretrained_accepts_the_finite_export() -> None:
    model = _load(modelopt_fixture("nvfp4"))
    assert any(isinstance(module, QuantLinear) for module in model.modules())
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
