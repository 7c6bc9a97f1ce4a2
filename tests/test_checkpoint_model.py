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
from qscheme.errors import CheckpointError, UsageError
from qscheme.modules import QuantLinear


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


def _snapshot(model: torch.nn.Module) -> tuple[dict[str, type], dict[str, torch.Tensor]]:
    modules = {name: type(module) for name, module in model.named_modules()}
    return modules, {name: value.detach().clone() for name, value in model.state_dict().items()}


@pytest.mark.parametrize(
    ("overrides", "options", "error"),
    [
        ({"attention_bias": True}, {}, "the model's Linear has bias but the checkpoint disagrees"),
        ({"vocab_size": 1024}, {}, r"tensor 'lm_head.weight' is \[256, 128\] in the checkpoint but \[1024, 128\]"),
        ({"num_hidden_layers": 2}, {}, "does not provide the model's model.layers.1"),
        ({}, {"fuse": {"gate_up_proj": ["gate_proj", "up_proj"]}}, "the model has no module '.*gate_up_proj'"),
        (
            {"tie_word_embeddings": True},
            {},
            r"the model ties '(lm_head|model\.embed_tokens)\.weight' and '(lm_head|model\.embed_tokens)\.weight' "
            r"\(one tensor\), but the checkpoint holds different values for them",
        ),
    ],
)
def test_a_failed_apply_leaves_the_model_as_it_was(
    overrides: dict[str, object], options: dict[str, object], error: str
) -> None:
    folder = ct_checkpoint("NVFP4A16")
    model = _model(folder, **overrides)
    modules, state = _snapshot(model)
    with pytest.raises(CheckpointError, match=error):
        apply_to_model(model, folder, kernel="reference", **options)  # type: ignore[arg-type]
    after_modules, after_state = _snapshot(model)
    assert after_modules == modules  # no nn.Linear was replaced
    assert after_state.keys() == state.keys()
    assert all(torch.equal(after_state[name], value) for name, value in state.items())  # nothing was copied in


def test_strict_false_leaves_out_what_the_model_lacks() -> None:
    folder = ct_checkpoint("NVFP4A16", num_layers=2)
    with pytest.raises(CheckpointError, match=r"the model has no module 'model\.layers\.1\.mlp\.down_proj'"):
        apply_to_model(_model(folder, num_hidden_layers=1), folder, kernel="reference")
    model = _model(folder, num_hidden_layers=1)
    checkpoint = apply_to_model(model, folder, kernel="reference", strict=False)
    assert isinstance(model.model.layers[0].self_attn.q_proj, QuantLinear)
    state = load_file(str(folder / "model.safetensors"))
    assert torch.equal(model.model.norm.weight, state["model.norm.weight"])
    notes = "\n".join(checkpoint.report.notes)
    assert "the model has no module for model.layers.1.mlp.down_proj" in notes
    assert "the model has no tensor model.layers.1.input_layernorm.weight" in notes


def test_strict_false_keeps_the_models_own_linear_for_a_fused_module_it_lacks() -> None:
    folder = ct_checkpoint("NVFP4A16")
    model = _model(folder)
    q_proj = model.model.layers[0].self_attn.q_proj
    checkpoint = apply_to_model(
        model, folder, kernel="reference", fuse={"qkv_proj": ["q_proj", "k_proj", "v_proj"]}, strict=False
    )
    assert model.model.layers[0].self_attn.q_proj is q_proj
    assert isinstance(model.model.layers[0].self_attn.o_proj, QuantLinear)
    assert any("model.layers.0.self_attn.qkv_proj; left out" in note for note in checkpoint.report.notes)


def test_a_model_on_the_meta_device_is_refused() -> None:
    folder = ct_checkpoint("NVFP4A16")
    config = AutoConfig.from_pretrained(str(folder))
    del config.quantization_config
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    with pytest.raises(UsageError) as caught:
        apply_to_model(model, folder, kernel="reference")
    assert str(caught.value) == (
        "apply_to_model: the model's 'model.embed_tokens.weight' is on the meta device, so nothing can be loaded "
        "into it; build the model on the device instead (e.g. LlamaForCausalLM(config) outside "
        "torch.device('meta')): model.to_empty() would leave the tensors the checkpoint does not hold, such as "
        "rotary inv_freq buffers, uninitialised"
    )
    with pytest.raises(UsageError, match=r"apply_to_model\(device='meta'\): nothing can be loaded onto the meta"):
        apply_to_model(_model(folder), folder, kernel="reference", device="meta")
    with pytest.raises(UsageError, match=r"apply_to_model\(device='gpu'\): not a device"):
        apply_to_model(_model(folder), folder, kernel="reference", device="gpu")


def test_a_model_that_is_not_a_module_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match=r"model must be a torch\.nn\.Module, not dict"):
        apply_to_model({}, "unused")  # type: ignore[arg-type]


def test_a_model_built_under_inference_mode_is_refused_before_anything_changes() -> None:
    folder = ct_checkpoint("NVFP4A16")
    with torch.inference_mode():
        model = _model(folder)
    modules, _ = _snapshot(model)
    with pytest.raises(
        UsageError, match=r"'.*' is an inference tensor \(the model was built under torch\.inference_mode"
    ):
        apply_to_model(model, folder, kernel="reference")
    assert _snapshot(model)[0] == modules  # no nn.Linear was replaced
    with torch.inference_mode():
        apply_to_model(model, folder, kernel="reference")  # inside it, the tensors can be written
    assert isinstance(model.model.layers[0].mlp.down_proj, QuantLinear)


def test_a_converted_models_state_dict_loads_into_another() -> None:
    folder = ct_checkpoint("NVFP4A16")
    source, target = _model(folder), _model(folder)
    apply_to_model(source, folder, kernel="reference")
    apply_to_model(target, folder, kernel="reference")
    tokens = torch.tensor([[1, 5, 9, 2]])
    expected = source(tokens).logits
    layer = target.model.layers[0].mlp.down_proj
    assert isinstance(layer, QuantLinear)
    layer.canonical_scale.copy_(layer.canonical_scale.float().mul(2).to(layer.canonical_scale.dtype))
    assert not torch.equal(target(tokens).logits, expected)
    state = source.state_dict()
    assert "model.layers.0.mlp.down_proj.canonical_codes" in state
    assert str(target.load_state_dict(state, strict=True)) == "<All keys matched successfully>"
    torch.testing.assert_close(target(tokens).logits, expected, rtol=0, atol=0)


def test_a_model_converted_before_or_with_other_projection_types_is_refused_with_the_way_out() -> None:
    folder = ct_checkpoint("NVFP4A16")
    model = _model(folder)
    apply_to_model(model, folder, kernel="reference")
    with pytest.raises(CheckpointError, match=r"is already a QuantLinear: apply_to_model was run on this model before"):
        apply_to_model(model, folder, kernel="reference")
    other = _model(folder)
    other.model.layers[0].mlp.down_proj = torch.nn.Conv1d(512, 256, 1)  # a projection of another module type
    with pytest.raises(CheckpointError) as caught:
        apply_to_model(other, folder, kernel="reference")
    message = str(caught.value)
    assert "'model.layers.0.mlp.down_proj' is a Conv1d, not an nn.Linear: apply_to_model replaces nn.Linear" in message
    assert "use qscheme.load_checkpoint(path) and call its layers" in message


@pytest.mark.parametrize("preset", ["NVFP4", "W4A16_ASYM", "FP8_BLOCK"])
@pytest.mark.interpreter
def test_the_triton_kernel_runs_the_model_as_the_library_does(preset: str) -> None:
    """The whole model on the Triton kernel (interpreted on the CPU): logits as the library's
    fake-quantized model gives them, and the same greedy tokens as the reference kernel."""
    from qscheme.triton.linear import interpreted

    if not interpreted():
        pytest.skip("the Triton kernel runs on the CPU only under TRITON_INTERPRET=1")
    folder = ct_checkpoint(preset)
    model = _model(folder)
    apply_to_model(model, folder, kernel="triton")
    assert model.model.layers[0].mlp.down_proj.kernel.name == "triton"
    reference = load_file(str(folder / "reference.safetensors"))
    with torch.no_grad():
        logits = model(reference["tokens"]).logits
    error = float((logits - reference["logits"]).abs().max())
    assert error <= 1e-4 * float(reference["logits"].abs().max()), error

    prompt = reference["tokens"][:1, :4]
    with torch.no_grad():
        tokens = model.generate(prompt, max_new_tokens=4, do_sample=False)
        baseline = _model(folder)
        apply_to_model(baseline, folder, kernel="reference")
        expected = baseline.generate(prompt, max_new_tokens=4, do_sample=False)
    assert torch.equal(tokens, expected)
