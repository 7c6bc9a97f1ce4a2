"""Issue 27's reported MoE failures, each as a tiny checkpoint: an expert without its global scale,
and an expert without its activation scale. Each must be a typed error naming the expert and the
tensor, never a weight dequantized without its global scale or an activation scale of 1/0."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from checkpoint_cache import scratch_root, single_threaded_torch  # noqa: F401
from safetensors.torch import load_file, save_file
from test_experts import write_moe_checkpoint

import qscheme
from qscheme.errors import QSchemeError

EXPERT = "model.layers.1.mlp.experts.5.up_proj"
ESCAPED = re.escape(EXPERT)


def _without(folder: Path, tensor: str) -> Path:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    assert tensor in tensors  # the damage is real: the tensor was there
    del tensors[tensor]
    save_file(tensors, str(path))
    return folder


def test_an_expert_without_its_global_scale_is_refused(tmp_path: Path) -> None:
    folder = _without(write_moe_checkpoint(tmp_path / "m", "NVFP4A16"), f"{EXPERT}.weight_global_scale")
    with pytest.raises(QSchemeError, match=rf"{ESCAPED}.*weight_global_scale"):
        qscheme.load_checkpoint(folder)


def test_an_expert_without_its_activation_scale_is_refused(tmp_path: Path) -> None:
    """compressed-tensors NVFP4 (W4A4) stores a static input_global_scale per expert."""
    folder = write_moe_checkpoint(tmp_path / "m", "NVFP4A16")
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    for name in [n for n in tensors if n.endswith(".weight_global_scale")]:
        tensors[name.replace(".weight_global_scale", ".input_global_scale")] = torch.tensor([448.0 * 6.0 / 4.0])
    save_file(tensors, str(path))
    config = json.loads((folder / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]
    group["input_activations"] = {
        "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
        "dynamic": "local",
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    assert len(qscheme.load_checkpoint(folder)) > 0  # the intact checkpoint loads
    _without(folder, f"{EXPERT}.input_global_scale")
    with pytest.raises(QSchemeError, match=rf"{ESCAPED}.*input_global_scale"):
        qscheme.load_checkpoint(folder)
