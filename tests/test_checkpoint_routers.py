"""A checkpoint that quantized an MoE router is refused with the ``--ignore`` fix.

transformers 5 builds Qwen3-MoE's ``mlp.gate`` as a router module, not an nn.Linear, so the
quantized router cannot be loaded; the refusal (apply_to_model, from_pretrained) names the
entry that requantizes without it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file
from test_experts import build_moe, cached_moe_checkpoint

from qscheme import apply_to_model, quantize_weight
from qscheme.checkpoint.routers import ignore_entry, router_hint
from qscheme.errors import CheckpointError

FIX = "requantize with --ignore 're:.*mlp.gate$'"


@pytest.mark.parametrize(
    ("module", "kind", "entry"),
    [
        ("model.layers.3.mlp.gate", "Qwen3MoeTopKRouter", "re:.*mlp.gate$"),
        ("model.layers.0.block_sparse_moe.gate", "MixtralTopKRouter", "re:.*block_sparse_moe.gate$"),
        ("model.layers.12.feed_forward.router", "Llama4Router", "re:.*feed_forward.router$"),
        ("model.layers.1.mlp.shared_expert_gate", "Linear", "re:.*mlp.shared_expert_gate$"),
        ("language_model.layers.2.moe.switch", "SomeTopKRouter", "re:.*moe.switch$"),  # by its type's name
    ],
)
def test_a_router_gets_the_ignore_entry_for_every_layer(module: str, kind: str, entry: str) -> None:
    assert ignore_entry(module) == entry
    hint = router_hint(module, kind)
    assert f"is an MoE router ({kind})" in hint and f"--ignore '{entry}'" in hint


def test_other_modules_get_no_hint() -> None:
    assert router_hint("model.layers.0.mlp.down_proj", "Conv1D") == ""
    assert router_hint("transformer.h.0.attn.c_attn", "Conv1D") == ""


@pytest.fixture(scope="module")
def quantized_router(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-MoE NVFP4A16 checkpoint with its routers quantized too (not ignored)."""
    folder = tmp_path_factory.mktemp("router") / "checkpoint"
    shutil.copytree(cached_moe_checkpoint("NVFP4A16"), folder)
    tensors = load_file(folder / "model.safetensors")
    routers = [name.removesuffix(".weight") for name in tensors if name.endswith("mlp.gate.weight")]
    assert routers
    for router in routers:
        weight = tensors.pop(f"{router}.weight")
        for key, value in quantize_weight(weight, "compressed-tensors/NVFP4A16").items():
            tensors[f"{router}.{key}"] = value
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["lm_head"]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_apply_to_model_names_the_fix(quantized_router: Path) -> None:
    with pytest.raises(CheckpointError, match="is an MoE router") as caught:
        apply_to_model(build_moe(), quantized_router)
    assert FIX in str(caught.value) and "'model.layers.0.mlp.gate'" in str(caught.value)


def test_from_pretrained_names_the_fix(quantized_router: Path) -> None:
    from transformers import AutoModelForCausalLM

    from qscheme.transformers import via_qscheme

    with pytest.raises(CheckpointError, match="is an MoE router") as caught:
        AutoModelForCausalLM.from_pretrained(
            quantized_router, config=via_qscheme(quantized_router), dtype=torch.float32
        )
    assert FIX in str(caught.value)
