"""apply_to_model and from_gguf with GGUF files: logits equal a dense model holding the weights
transformers' own GGUF loader dequantizes (float32, 1e-4), MoE included; model/file mismatches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_tiny import Q8_0, dense_model, model_of, uniform, write_tiny_gguf

import qscheme
from qscheme.errors import CheckpointError
from qscheme.modules import QuantExperts, QuantLinear

TOKENS = torch.tensor([[1, 5, 9, 33, 2, 60, 7, 12, 40, 3]])


def mixed(name: str, shape: tuple[int, ...]) -> str:
    if len(shape) < 2 or ".ffn_gate_inp." in name:
        return "F32"
    return "Q4_K" if ".attn_" in name or "token_embd" in name else "Q6_K"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf_model")


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    ("family", "types", "tie"),
    [
        ("llama", uniform("Q4_0"), False),
        ("mistral", Q8_0, True),
        ("qwen2", mixed, False),
        ("qwen3", mixed, True),
        ("qwen3moe", mixed, False),
        ("qwen3moe", uniform("Q8_0"), True),
    ],
)
def test_apply_to_model_logits_equal_the_dense_dequantized_model(
    folder: Path, family: str, types: object, tie: bool
) -> None:
    written = write_tiny_gguf(folder / f"{family}-{tie}.gguf", family, types, tie=tie)  # type: ignore[arg-type]
    model = model_of(written.path)
    before = _logits(model)
    checkpoint = qscheme.apply_to_model(model, written.path)
    expected = _logits(dense_model(written.path))
    got = _logits(model)
    assert not torch.allclose(before, expected, atol=1e-2)  # the random model differs: the load did the work
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    layers = dict(model.named_modules())
    assert isinstance(layers["model.layers.0.self_attn.q_proj"], QuantLinear)
    assert isinstance(layers["lm_head"], QuantLinear) != tie  # tied: the embedding, dequantized
    assert isinstance(layers["model.embed_tokens"], torch.nn.Embedding)  # a quantized token_embd, dequantized
    if family == "qwen3moe":
        assert isinstance(layers["model.layers.1.mlp.experts"], QuantExperts)
    assert checkpoint.report.producer == "gguf"


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_embedding_is_dequantized_in_the_model_dtype(folder: Path) -> None:
    written = write_tiny_gguf(folder / "embed.gguf", "llama", mixed)
    model = model_of(written.path, dtype=torch.bfloat16)
    checkpoint = qscheme.apply_to_model(model, written.path)
    embedding = model.model.embed_tokens.weight
    assert embedding.dtype == torch.bfloat16
    assert torch.equal(embedding, checkpoint["model.embed_tokens"].dequantize().to(torch.bfloat16))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_from_gguf_keeps_weights_quantized(folder: Path) -> None:
    from qscheme.transformers import from_gguf

    written = write_tiny_gguf(folder / "from.gguf", "qwen3moe", mixed, tie=True)
    model = from_gguf(written.path, dtype=torch.float32)
    assert isinstance(model.model.layers[0].mlp.experts, QuantExperts)
    assert model.qscheme_checkpoint.report.producer == "gguf"
    torch.testing.assert_close(_logits(model), _logits(dense_model(written.path)), atol=1e-4, rtol=1e-4)


def test_a_model_missing_a_layer_the_file_has_is_refused(folder: Path) -> None:
    written = write_tiny_gguf(folder / "missing.gguf", "llama", Q8_0)
    model = model_of(written.path)
    del model.model.layers[1].mlp.up_proj
    state = {name: value.clone() for name, value in model.state_dict().items()}
    expected = r"missing\.gguf: the model has no module 'model\.layers\.1\.mlp\.up_proj'"
    with pytest.raises(CheckpointError, match=expected):
        qscheme.apply_to_model(model, written.path)
    assert all(torch.equal(value, state[name]) for name, value in model.state_dict().items())  # unchanged


def test_a_model_with_a_layer_the_file_lacks_is_refused(folder: Path) -> None:
    written = write_tiny_gguf(folder / "short.gguf", "llama", Q8_0)
    model = model_of(written.path)
    model.model.extra_norm = torch.nn.LayerNorm(4)
    with pytest.raises(CheckpointError, match=r"short\.gguf: the checkpoint does not provide .*model\.extra_norm"):
        qscheme.apply_to_model(model, written.path)


def test_a_model_of_other_shapes_is_refused(folder: Path) -> None:
    written = write_tiny_gguf(folder / "other.gguf", "llama", Q8_0)
    model = model_of(written.path)
    model.model.layers[0].mlp.up_proj = torch.nn.Linear(256, 128, bias=False)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.up_proj'.*\[128, 256\].*\[512, 256\]"):
        qscheme.apply_to_model(model, written.path)
