"""DeepSeek-style FP8-block models through ``from_pretrained`` (the opt-in ``qscheme-fp8`` route)
and ``apply_to_model``, against a dense model holding the published block dequantization and
against transformers' own ``fp8`` loader.

transformers 5.24's fp8 quantizer runs on a CPU by dequantizing (``FineGrainedFP8Config``
``dequantize=True``, set for itself when there is no GPU): its weights are the dequantized float
weights in plain ``nn.Linear`` (and fused experts) modules, with no activation quantization. It
takes the block size from the scale grid, so it reads only models whose weight sides are whole
multiples of 128 (the aligned models below); the ragged model is compared with the dense
reference alone.

The checkpoints declare ``activation_scheme: dynamic``: activations are quantized to e4m3 per
token and group of 128 channels at run time ("online quantization at a granularity of
per-token-per-128-channel", DeepSeek-V3's README_WEIGHTS.md), which qscheme's reference kernel
computes. The reference models get the same quantization from ``published_activation``, written
here from that description (scale = amax / 448 per token and group, codes = e4m3(x / scale)),
applied to the input of every quantized linear (expert projections included). Everything is
float32: logits agree to 1e-5 of their largest magnitude (float32 summation order only).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from checkpoint_cache import single_threaded_torch  # noqa: F401
from fp8_checkpoint import E4M3_MAX, write_fp8_checkpoint
from safetensors.torch import load_file
from test_fp8_producer import published_dequantize, tiny_llama
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

import qscheme
from qscheme.modules import QuantExperts, QuantLinear
from qscheme.transformers import via_qscheme

TOKENS = torch.tensor([[1, 5, 9, 100, 33, 7, 64, 2]])
LOGITS = 1e-5  # relative to max |logit|
ALIGNED = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2, "head_dim": 64}


def published_activation(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """e4m3 quantize-dequantize of each token per group of 128 channels (the last group zero-padded)."""
    columns = x.shape[-1]
    padded = torch.nn.functional.pad(x.float(), (0, math.ceil(columns / group) * group - columns))
    groups = padded.unflatten(-1, (-1, group))
    scale = groups.abs().amax(dim=-1, keepdim=True) / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (groups / scale).to(torch.float8_e4m3fn)
    return (codes.float() * scale).flatten(-2)[..., :columns].to(x.dtype)


@contextlib.contextmanager
def quantized_inputs(weights: list[torch.Tensor]) -> Iterator[None]:
    """Every F.linear whose weight lives in one of ``weights``' storages gets ``published_activation``
    of its input (nn.Linear and transformers' experts both call torch.nn.functional.linear)."""
    storages = {weight.untyped_storage().data_ptr() for weight in weights}
    plain = torch.nn.functional.linear

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if weight.untyped_storage().data_ptr() in storages:
            x = published_activation(x)
        return plain(x, weight, bias)

    torch.nn.functional.linear = linear
    try:
        yield
    finally:
        torch.nn.functional.linear = plain


def logits(model: torch.nn.Module, quantized: list[torch.Tensor] | None = None) -> torch.Tensor:
    with torch.no_grad(), quantized_inputs(quantized or []):
        return model(TOKENS).logits.float()


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    error = float((actual - expected).abs().max())
    assert error <= LOGITS * float(expected.abs().max()), error


def dense_reference(model: torch.nn.Module, folder: Path) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """``model`` holding the checkpoint's plain tensors and the published dequantization of every
    quantized Linear (the list: those weights)."""
    tensors = load_file(str(folder / "model.safetensors"))
    state = {
        name: value for name, value in tensors.items() if value.dtype != torch.float8_e4m3fn and "scale_inv" not in name
    }
    for name, value in tensors.items():
        if value.dtype == torch.float8_e4m3fn:
            state[name] = published_dequantize(value, tensors[name + "_scale_inv"])
    model.load_state_dict(state, strict=True)
    quantized = [
        model.get_submodule(name.removesuffix(".weight")).weight
        for name in tensors
        if tensors[name].dtype == torch.float8_e4m3fn
    ]
    return model.eval(), quantized


def quantized_weights_of(model: torch.nn.Module, names: list[str]) -> list[torch.Tensor]:
    return [model.get_submodule(name).weight for name in names]


@pytest.fixture(scope="module")
def ragged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fp8_checkpoint(tmp_path_factory.mktemp("fp8-llama") / "ragged", tiny_llama())


@pytest.fixture(scope="module")
def aligned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fp8_checkpoint(tmp_path_factory.mktemp("fp8-llama") / "aligned", tiny_llama(**ALIGNED))


def test_from_pretrained_and_apply_to_model_equal_the_dense_dequantized_model(ragged: Path) -> None:
    ours = AutoModelForCausalLM.from_pretrained(ragged, config=via_qscheme(ragged)).eval()
    layers = {name: m for name, m in ours.named_modules() if isinstance(m, QuantLinear)}
    assert len(layers) == 7 and {m.scheme.name for m in layers.values()} == {"fp8/FP8_BLOCK"}
    applied = tiny_llama(seed=1)
    qscheme.apply_to_model(applied, ragged)
    dense, quantized = dense_reference(tiny_llama(seed=2), ragged)
    expected = logits(dense, quantized)
    assert_close(logits(ours), expected)
    assert_close(logits(applied), expected)
    # the activation quantization is what the checkpoint declares: without it the logits differ
    assert float((logits(dense) - expected).abs().max()) > 100 * LOGITS * float(expected.abs().max())


def test_logits_and_weights_equal_transformers_own_fp8_loader(aligned: Path) -> None:
    theirs = AutoModelForCausalLM.from_pretrained(aligned).eval()  # transformers' fp8 quantizer, dequantizing
    assert not any(isinstance(m, QuantLinear) for m in theirs.modules())
    ours = AutoModelForCausalLM.from_pretrained(aligned, config=via_qscheme(aligned)).eval()
    layers = {name: m for name, m in ours.named_modules() if isinstance(m, QuantLinear)}
    assert len(layers) == 7
    for name, layer in layers.items():
        their_weight = theirs.get_submodule(name).weight
        assert their_weight.dtype == torch.float32 and torch.equal(layer.dequantize(), their_weight.detach()), name
    assert_close(logits(ours), logits(theirs, quantized_weights_of(theirs, list(layers))))


def tiny_moe(seed: int) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=128,
        moe_intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=64,
        tie_word_embeddings=False,
        norm_topk_prob=True,
    )
    return Qwen3MoeForCausalLM(config).eval()


def test_a_moe_model_loads_its_experts_quantized_and_equals_transformers_own_loader(tmp_path: Path) -> None:
    folder = write_fp8_checkpoint(tmp_path / "moe", tiny_moe(0))
    tensors = load_file(str(folder / "model.safetensors"))
    assert tensors["model.layers.0.mlp.experts.3.down_proj.weight_scale_inv"].shape == (1, 1)
    assert tensors["model.layers.0.mlp.gate.weight"].dtype == torch.float32  # the router stays 16/32-bit
    ours = AutoModelForCausalLM.from_pretrained(folder, config=via_qscheme(folder)).eval()
    experts = ours.get_submodule("model.layers.0.mlp.experts")
    assert isinstance(experts, QuantExperts)
    theirs = AutoModelForCausalLM.from_pretrained(folder).eval()
    theirs.set_experts_implementation("eager")  # its per-expert loop calls F.linear, where the inputs are quantized
    fused = theirs.get_submodule("model.layers.0.mlp.experts")
    for e in range(4):
        gate = ours.get_submodule(f"model.layers.0.mlp.experts.{e}.gate_proj").dequantize()
        up = ours.get_submodule(f"model.layers.0.mlp.experts.{e}.up_proj").dequantize()
        down = ours.get_submodule(f"model.layers.0.mlp.experts.{e}.down_proj").dequantize()
        assert torch.equal(torch.cat([gate, up]), fused.gate_up_proj[e].detach())
        assert torch.equal(down, fused.down_proj[e].detach())
    attention = [f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"]
    quantized = [*quantized_weights_of(theirs, attention), fused.gate_up_proj, fused.down_proj]
    expected = logits(theirs, quantized)
    assert_close(logits(ours), expected)
    dense, _ = dense_reference_moe(folder)
    assert_close(logits(dense, [*quantized_weights_of(dense, attention), *experts_of(dense)]), expected)


def experts_of(model: torch.nn.Module) -> list[torch.Tensor]:
    fused = model.get_submodule("model.layers.0.mlp.experts")
    return [fused.gate_up_proj, fused.down_proj]


def dense_reference_moe(folder: Path) -> tuple[torch.nn.Module, None]:
    """The tiny MoE holding the published dequantization, its experts fused as transformers holds them."""
    tensors = load_file(str(folder / "model.safetensors"))
    model = tiny_moe(seed=1)
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, value in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if value.dtype == torch.float8_e4m3fn:
            value = published_dequantize(value, tensors[name + "_scale_inv"])
        if ".experts." in name:
            module, _, rest = name.partition(".experts.")
            index, projection, _ = rest.split(".")
            experts.setdefault(module + ".experts", {}).setdefault(int(index), {})[projection] = value
        else:
            state[name] = value
    for module, per_expert in experts.items():
        order = sorted(per_expert)
        state[f"{module}.gate_up_proj"] = torch.stack(
            [torch.cat([per_expert[e]["gate_proj"], per_expert[e]["up_proj"]]) for e in order]
        )
        state[f"{module}.down_proj"] = torch.stack([per_expert[e]["down_proj"] for e in order])
    model.load_state_dict(state, strict=True)
    model.set_experts_implementation("eager")
    return model.eval(), None
