"""apply_to_model: a transformers LlamaForCausalLM built from the checkpoint's config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoint_cache import (
    ct_checkpoint,
    modelopt_fixture,
    single_threaded_torch,  # noqa: F401  (autouse)
)
from safetensors.torch import load_file
from transformers import AutoConfig, LlamaForCausalLM

from qscheme.checkpoint import apply_to_model
from qscheme.errors import CheckpointError
from qscheme.linear import QuantLinear


def _model(folder: Path, dtype: torch.dtype = torch.float32, **overrides: object) -> LlamaForCausalLM:
    config = AutoConfig.from_pretrained(str(folder))
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the model is built plain; qscheme puts the quantized layers in
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval().to(dtype)


@pytest.mark.parametrize("preset", ["NVFP4", "W4A16_ASYM", "FP8_BLOCK"])
def test_logits_match_the_libraries_fake_quantized_model(preset: str) -> None:
    folder = ct_checkpoint(preset)
    model = _model(folder)
    checkpoint = apply_to_model(model, folder, kernel="reference")
    assert isinstance(model.model.layers[0].self_attn.q_proj, QuantLinear)
    assert isinstance(model.lm_head, torch.nn.Linear) and not isinstance(model.lm_head, QuantLinear)
    assert len(checkpoint) == 7
    reference = load_file(str(folder / "reference.safetensors"))
    with torch.no_grad():
        logits = model(reference["tokens"]).logits
    error = float((logits - reference["logits"]).abs().max())
    assert error <= 1e-5 * float(reference["logits"].abs().max()), error


def test_modelopt_bf16_checkpoint_with_excluded_layers() -> None:
    folder = modelopt_fixture("nvfp4_exclude")
    model = _model(folder, torch.bfloat16)
    apply_to_model(model, folder, kernel="reference")
    assert isinstance(model.model.layers[0].mlp.up_proj, QuantLinear)
    assert not isinstance(model.model.layers[0].mlp.down_proj, QuantLinear)
    assert not isinstance(model.model.layers[1].self_attn.q_proj, QuantLinear)
    state = load_file(str(folder / "model.safetensors"))
    assert torch.equal(model.model.layers[1].self_attn.q_proj.weight, state["model.layers.1.self_attn.q_proj.weight"])
    assert model.model.layers[0].mlp.up_proj.kernel.name == "reference"
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 256) and bool(torch.isfinite(logits).all())


def test_shape_mismatch_names_the_module() -> None:
    folder = ct_checkpoint("NVFP4A16")
    model = _model(folder, intermediate_size=512)
    with pytest.raises(
        CheckpointError, match=r"module 'model.layers.0.mlp.down_proj': the model's Linear is \[128, 512\]"
    ):
        apply_to_model(model, folder, kernel="reference")


def test_missing_model_module_and_strictness() -> None:
    folder = ct_checkpoint("NVFP4A16")
    with pytest.raises(CheckpointError, match=r"the model has no module 'model\.layers\.0\.self_attn\.qkv_proj'"):
        apply_to_model(_model(folder), folder, kernel="reference", fuse={"qkv_proj": ["q_proj", "k_proj", "v_proj"]})
    bigger = _model(folder, num_hidden_layers=2)
    with pytest.raises(CheckpointError, match=r"does not provide the model's model.layers.1"):
        apply_to_model(bigger, folder, kernel="reference")
    apply_to_model(_model(folder, num_hidden_layers=2), folder, kernel="reference", strict=False)


def test_bias_disagreement_is_an_error() -> None:
    folder = ct_checkpoint("NVFP4A16")
    with pytest.raises(CheckpointError, match="the model's Linear has bias but the checkpoint disagrees"):
        apply_to_model(_model(folder, attention_bias=True), folder, kernel="reference")
