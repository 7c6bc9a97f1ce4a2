"""gpt-oss MXFP4 checkpoints (quant_method mxfp4) against transformers' own mxfp4 integration.

OpenAI's writer is not installable here; the checkpoints are built from the documented layout
(tests/gpt_oss_checkpoint.py) and the first test pins that layout against transformers' code.
The oracle is transformers itself, on CPU: ``convert_moe_packed_tensors`` for the dequantized
experts, and ``GptOssForCausalLM.from_pretrained`` (which dequantizes mxfp4 on a CPU without
triton kernels) for the logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpt_oss_checkpoint import tiny_gpt_oss_config, write_gpt_oss_checkpoint
from safetensors.torch import load_file
from transformers import GptOssForCausalLM, Mxfp4Config
from transformers.integrations import mxfp4 as hf_mxfp4
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.quantizers.quantizer_mxfp4 import Mxfp4HfQuantizer
from transformers.utils import logging as hf_logging

import qscheme
from qscheme.cli.main import main
from qscheme.errors import QSchemeError
from qscheme.modules import QuantExperts
from qscheme.transformers import via_qscheme

# transformers' own dequantization (from 5.25, with triton and its kernels package on a CPU, it
# otherwise fetches Triton kernels from the Hub)
DEQUANTIZE = Mxfp4Config(dequantize=True)
TOKENS = torch.tensor([[1, 5, 9, 33, 2, 7, 100, 3, 64, 12]])
EXPERTS = "model.layers.1.mlp.experts"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gpt_oss_checkpoint(tmp_path_factory.mktemp("gpt_oss") / "ckpt")


@pytest.fixture(scope="module")
def transformers_logits(folder: Path) -> torch.Tensor:
    hf_logging.set_verbosity_error()
    model = GptOssForCausalLM.from_pretrained(folder, dtype=torch.float32, quantization_config=DEQUANTIZE).eval()
    assert type(model.model.layers[0].mlp.experts) is GptOssExperts  # transformers dequantized on CPU
    with torch.no_grad():
        return model(TOKENS).logits


def _damaged(tmp_path: Path, damage) -> Path:  # type: ignore[no-untyped-def]
    return write_gpt_oss_checkpoint(tmp_path / "damaged", damage=damage)


def test_the_layout_is_transformers_own(folder: Path) -> None:
    """Names, shapes and dtypes of the built checkpoint, checked against transformers' reader."""
    config = tiny_gpt_oss_config()
    experts, hidden, inner = config.num_local_experts, config.hidden_size, config.intermediate_size
    state = load_file(folder / "model.safetensors")
    quantizer_names = Mxfp4HfQuantizer.serialized_names
    assert quantizer_names == {
        "gate_up_proj": ["gate_up_proj_blocks", "gate_up_proj_scales"],
        "down_proj": ["down_proj_blocks", "down_proj_scales"],
    }
    with torch.device("meta"):
        packed = hf_mxfp4.Mxfp4GptOssExperts(config)
        dense = GptOssExperts(config)
    for projection in ("gate_up_proj", "down_proj"):
        blocks = state[f"{EXPERTS}.{projection}_blocks"]
        scales = state[f"{EXPERTS}.{projection}_scales"]
        bias = state[f"{EXPERTS}.{projection}_bias"]
        # transformers' packed parameter is the blocks with the last two dimensions joined
        assert blocks.dtype == scales.dtype == torch.uint8 == getattr(packed, projection).dtype
        assert (*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1]) == tuple(getattr(packed, projection).shape)
        assert blocks.shape[:-1] == scales.shape and blocks.shape[-1] == 16
        assert bias.dtype == torch.bfloat16 and bias.shape == getattr(dense, f"{projection}_bias").shape
        # the dequantized stack is the dense module's parameter (transposed: [E, K, N])
        values = hf_mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert values.shape == getattr(dense, projection).shape
    assert dense.is_transposed and not dense.is_concatenated and dense.has_bias  # the flags QuantExperts follows
    assert state[f"{EXPERTS}.gate_up_proj_blocks"].shape == (experts, 2 * inner, hidden // 32, 16)
    assert not any(name.startswith("model.layers.0.self_attn") and "blocks" in name for name in state)


def test_every_expert_dequantizes_bit_identical_to_transformers(folder: Path) -> None:
    checkpoint = qscheme.load_checkpoint(folder)
    state = load_file(folder / "model.safetensors")
    for layer in (0, 1):
        for projection in ("gate_up_proj", "down_proj"):
            stacked = f"model.layers.{layer}.mlp.experts.{projection}"
            expected = hf_mxfp4.convert_moe_packed_tensors(
                state[f"{stacked}_blocks"], state[f"{stacked}_scales"], dtype=torch.float32
            )
            for expert in range(expected.shape[0]):
                loaded = checkpoint[f"model.layers.{layer}.mlp.experts.{expert}.{projection}"]
                assert torch.equal(loaded.dequantize(), expected[expert].T)  # [N, K]: rows as stored
                assert torch.equal(loaded.bias, state[f"{stacked}_bias"][expert])


def test_every_code_and_scale_byte_decodes_as_transformers(tmp_path: Path) -> None:
    """All 256 code bytes (both nibbles) under every scale byte transformers' float32 holds."""

    def every_byte(state: dict[str, torch.Tensor]) -> None:
        blocks = state[f"{EXPERTS}.gate_up_proj_blocks"]
        codes = torch.arange(256, dtype=torch.uint8).repeat(blocks.numel() // 256 + 1)[: blocks.numel()]
        state[f"{EXPERTS}.gate_up_proj_blocks"] = codes.reshape(blocks.shape)
        scales = state[f"{EXPERTS}.gate_up_proj_scales"]
        wide = torch.arange(scales.numel(), dtype=torch.int64) % 200 + 27  # 2**-100 .. 2**99
        state[f"{EXPERTS}.gate_up_proj_scales"] = wide.to(torch.uint8).reshape(scales.shape)

    folder = _damaged(tmp_path, every_byte)
    state = load_file(folder / "model.safetensors")
    expected = hf_mxfp4.convert_moe_packed_tensors(
        state[f"{EXPERTS}.gate_up_proj_blocks"], state[f"{EXPERTS}.gate_up_proj_scales"], dtype=torch.float32
    )
    checkpoint = qscheme.load_checkpoint(folder)
    for expert in range(expected.shape[0]):
        assert torch.equal(checkpoint[f"{EXPERTS}.{expert}.gate_up_proj"].dequantize(), expected[expert].T)


def test_apply_to_model_equals_transformers_and_the_dense_model(
    folder: Path, transformers_logits: torch.Tensor
) -> None:
    model = GptOssForCausalLM(tiny_gpt_oss_config()).eval()
    qscheme.apply_to_model(model, folder)
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts, QuantExperts) and experts.spec.interleaved and experts.spec.has_bias
    with torch.no_grad():
        logits = model(TOKENS).logits
    torch.testing.assert_close(logits, transformers_logits, rtol=0, atol=1e-5)
    # the dense model: transformers' own GptOssExperts holding the dequantized weights and the biases
    dense = GptOssForCausalLM(tiny_gpt_oss_config()).eval()
    dense.load_state_dict(model.state_dict(), strict=False)
    for index, layer in enumerate(model.model.layers):
        gate_up, down = layer.mlp.experts.dequantized()
        target = dense.model.layers[index].mlp.experts
        biases = [
            torch.stack([layer.mlp.experts.expert(e).gate_up_proj.bias.float() for e in range(4)]),
            torch.stack([layer.mlp.experts.expert(e).down_proj.bias.float() for e in range(4)]),
        ]
        with torch.no_grad():
            target.gate_up_proj.copy_(gate_up)
            target.down_proj.copy_(down)
            target.gate_up_proj_bias.copy_(biases[0])
            target.down_proj_bias.copy_(biases[1])
    with torch.no_grad():
        torch.testing.assert_close(logits, dense(TOKENS).logits, rtol=0, atol=1e-5)


def test_from_pretrained_through_the_qscheme_route(folder: Path, transformers_logits: torch.Tensor) -> None:
    hf_logging.set_verbosity_error()
    model = GptOssForCausalLM.from_pretrained(folder, config=via_qscheme(folder), dtype=torch.float32).eval()
    assert isinstance(model.model.layers[0].mlp.experts, QuantExperts)
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS).logits, transformers_logits, rtol=0, atol=1e-5)


def test_inspect_and_resolve_name_every_expert(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(folder)]) == 0
    inspected = capsys.readouterr().out
    assert "producer: mxfp4 (config.json)" in inspected
    assert "model.layers.*.mlp.experts.{0..3}.gate_up_proj  mxfp4/MXFP4  256x64  8" in inspected
    assert "ignored modules (12)" in inspected and "problems: none" in inspected
    assert main(["resolve", str(folder), "--device", "cpu"]) == 0
    resolved = capsys.readouterr().out
    assert "model.layers.*.mlp.experts.{0..3}.down_proj     mxfp4/MXFP4  64x128  8" in resolved
    assert "16 of 16 layers have a kernel" in resolved


# ---------------------------------------------------------------------------- strictness (issue 27, point 7)


def test_experts_missing_from_the_checkpoint_are_refused(tmp_path: Path) -> None:
    def drop_layer_experts(state: dict[str, torch.Tensor]) -> None:
        for name in [n for n in state if n.startswith(EXPERTS)]:
            del state[name]

    folder = _damaged(tmp_path, drop_layer_experts)
    model = GptOssForCausalLM(tiny_gpt_oss_config())
    with pytest.raises(QSchemeError, match=r"model\.layers\.1\.mlp\.experts"):
        qscheme.apply_to_model(model, folder)


def test_a_scales_tensor_of_the_wrong_shape_is_refused(tmp_path: Path) -> None:
    def narrow(state: dict[str, torch.Tensor]) -> None:
        state[f"{EXPERTS}.down_proj_scales"] = state[f"{EXPERTS}.down_proj_scales"][..., :-1].contiguous()

    with pytest.raises(QSchemeError, match=r"experts\.0\.down_proj\.scales.*expected shape \[N, K/32\] = \[64, 4\]"):
        qscheme.load_checkpoint(_damaged(tmp_path, narrow))


def test_an_orphan_tensor_in_the_experts_module_is_refused(tmp_path: Path) -> None:
    def orphan(state: dict[str, torch.Tensor]) -> None:
        state[f"{EXPERTS}.router_scales"] = torch.zeros(4, 8, dtype=torch.uint8)

    with pytest.raises(QSchemeError, match=r"'model\.layers\.1\.mlp\.experts\.router_scales'.*orphan"):
        qscheme.load_checkpoint(_damaged(tmp_path, orphan))


def test_a_stray_per_expert_tensor_beside_the_stacked_one_is_refused(tmp_path: Path) -> None:
    """A stored tensor named as one expert's share of a stacked tensor would be silently replaced."""

    def stray(state: dict[str, torch.Tensor]) -> None:
        state[f"{EXPERTS}.2.down_proj.bias"] = torch.zeros(64, dtype=torch.bfloat16)

    with pytest.raises(QSchemeError, match=r"'model\.layers\.1\.mlp\.experts\.2\.down_proj\.bias' is stored beside"):
        qscheme.load_checkpoint(_damaged(tmp_path, stray))


def test_an_undeclared_per_projection_tensor_is_refused(tmp_path: Path) -> None:
    def extra(state: dict[str, torch.Tensor]) -> None:
        state[f"{EXPERTS}.gate_up_proj_zeros"] = torch.zeros(4, 256, 2, dtype=torch.uint8)

    with pytest.raises(QSchemeError, match=r"zeros"):
        qscheme.load_checkpoint(_damaged(tmp_path, extra))


def test_a_missing_bias_is_refused_when_the_model_has_biases(tmp_path: Path) -> None:
    def drop_bias(state: dict[str, torch.Tensor]) -> None:
        del state[f"{EXPERTS}.down_proj_bias"]

    folder = _damaged(tmp_path, drop_bias)
    with pytest.raises(QSchemeError, match=r"experts\.0\.down_proj: the model's experts \(GptOssExperts\) have biases"):
        qscheme.apply_to_model(GptOssForCausalLM(tiny_gpt_oss_config()), folder)


def test_a_transposed_blocks_tensor_is_refused(tmp_path: Path) -> None:
    def transpose(state: dict[str, torch.Tensor]) -> None:
        blocks = state[f"{EXPERTS}.gate_up_proj_blocks"]  # [E, 2I, H/32, 16] -> [E, H/32, 2I, 16]
        state[f"{EXPERTS}.gate_up_proj_blocks"] = blocks.transpose(1, 2).contiguous()

    with pytest.raises(QSchemeError, match=r"gate_up_proj"):
        qscheme.load_checkpoint(_damaged(tmp_path, transpose))


def test_a_blocks_tensor_without_its_16_byte_groups_is_refused(tmp_path: Path) -> None:
    def flatten(state: dict[str, torch.Tensor]) -> None:
        blocks = state[f"{EXPERTS}.down_proj_blocks"]
        state[f"{EXPERTS}.down_proj_blocks"] = blocks.reshape(4, 64, -1, 8).contiguous()

    with pytest.raises(QSchemeError, match=r"down_proj_blocks.*\[E, \.\.\., 16\]"):
        qscheme.load_checkpoint(_damaged(tmp_path, flatten))


def test_quantized_tensors_outside_the_experts_are_refused(tmp_path: Path) -> None:
    def quantize_router(state: dict[str, torch.Tensor]) -> None:
        state["model.layers.0.mlp.up.blocks"] = torch.zeros(8, 32, dtype=torch.uint8)
        state["model.layers.0.mlp.up.scales"] = torch.zeros(8, 2, dtype=torch.uint8)

    with pytest.raises(QSchemeError, match=r"quantizes only MoE experts"):
        qscheme.load_checkpoint(_damaged(tmp_path, quantize_router))
