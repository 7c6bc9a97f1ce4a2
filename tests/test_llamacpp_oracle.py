"""The llama.cpp oracle itself (tests/llamacpp_oracle.py) is sane: its C quantizer and dequantizer
agree with gguf's numpy code, its converter and whole-model quantizer write the types asked for,
and its forward pass matches transformers on the same tiny models."""

from __future__ import annotations

import os
import re
from pathlib import Path

import llamacpp_oracle as oracle
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

# gguf.quants can quantize these too (numpy ports of ggml's reference quantizers)
GGUF_QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "TQ1_0", "TQ2_0", "MXFP4")
# nominal bits per weight of each type's codes, for a loose error bound
CODE_BITS = {"Q8_0": 8, "Q6_K": 6, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q4_0": 4, "Q4_1": 4, "Q4_K": 4}
CODE_BITS |= {"IQ4_NL": 4, "IQ4_XS": 4, "MXFP4": 4, "NVFP4": 4, "Q3_K": 3, "IQ3_XXS": 3, "IQ3_S": 3}
CODE_BITS |= {"Q2_K": 2, "IQ2_S": 2, "TQ1_0": 1, "TQ2_0": 1}


def sample_weights(rows: int = 6, k: int = 512, seed: int = 0) -> np.ndarray:
    """Gaussian rows with a few outliers and an all-zero block (scales of zero must not divide)."""
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((rows, k)).astype(np.float32) * np.float32(0.05)
    weights[1, 7] = 0.9
    weights[2, 300] = -1.3
    weights[3, :256] = 0.0
    return weights


def row_bytes(type_name: str, k: int) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    return k // block * size


def test_type_lists_are_gguf_types() -> None:
    assert set(CODE_BITS) == set(oracle.QUANTIZE_TYPES)
    for name in oracle.QUANTIZE_TYPES:
        assert GGMLQuantizationType[name] in GGML_QUANT_SIZES


def test_unknown_type_is_refused_before_starting_the_oracle() -> None:
    with pytest.raises(ValueError, match=r"Q1_0.*allowed: Q4_0"):
        oracle.ggml_quantize(np.zeros((1, 128), np.float32), "Q1_0")


def test_k_not_a_block_multiple_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        oracle.ggml_quantize(np.zeros((1, 128), np.float32), "Q4_K")


def test_without_the_venv_the_test_skips_naming_the_build_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(oracle.ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match=re.escape(oracle.BUILD_COMMAND)):
        oracle.oracle_python()


@pytest.mark.oracle
@pytest.mark.parametrize("type_name", oracle.QUANTIZE_TYPES)
def test_c_quantizer_and_dequantizer_agree_with_gguf_numpy(type_name: str) -> None:
    weights = sample_weights()
    raw = oracle.ggml_quantize(weights, type_name)
    assert raw.dtype == np.uint8
    assert raw.shape == (weights.shape[0], row_bytes(type_name, weights.shape[1]))

    values = oracle.ggml_dequantize(raw, type_name, weights.shape[1])
    expected = gguf_dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float32)
    assert values.shape == weights.shape
    np.testing.assert_array_equal(values.view(np.uint32), expected.view(np.uint32))

    assert np.all(values[3, :256] == 0.0)
    relative_rms = np.sqrt(np.mean((values - weights) ** 2) / np.mean(weights**2))
    bound = {8: 0.01, 6: 0.05, 5: 0.1, 4: 0.2, 3: 0.4, 2: 0.8, 1: 1.0}[CODE_BITS[type_name]]
    assert relative_rms < bound, f"{type_name}: relative RMS error {relative_rms:.3f} >= {bound}"


@pytest.mark.oracle
@pytest.mark.parametrize("type_name", GGUF_QUANTIZABLE)
def test_c_quantizer_agrees_with_gguf_numpy_quantizer(type_name: str) -> None:
    weights = sample_weights(seed=1)
    raw = oracle.ggml_quantize(weights, type_name)
    np.testing.assert_array_equal(raw, gguf_quantize(weights, GGMLQuantizationType[type_name]))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return oracle.tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"), seed=3)


@pytest.fixture(scope="module")
def tiny_llama_f32(tiny_llama: Path) -> Path:
    return oracle.convert_hf_to_gguf(tiny_llama, tiny_llama / "model-f32.gguf", "f32")


def tensor_types(path: Path) -> dict[str, str]:
    return {tensor.name: tensor.tensor_type.name for tensor in gguf.GGUFReader(path).tensors}


def matrices(types: dict[str, str]) -> dict[str, str]:
    return {name: kind for name, kind in types.items() if not name.endswith("norm.weight")}


@pytest.mark.oracle
@pytest.mark.parametrize("outtype", ["f16", "q8_0"])  # f32: what the GGUF oracle tests convert to
def test_convert_writes_the_asked_type(tiny_llama: Path, tmp_path: Path, outtype: str) -> None:
    types = tensor_types(oracle.convert_hf_to_gguf(tiny_llama, tmp_path / "model.gguf", outtype))
    assert {"token_embd.weight", "output.weight", "blk.1.ffn_down.weight", "blk.0.attn_q.weight"} <= set(types)
    assert set(matrices(types).values()) == {outtype.upper()}
    assert {kind for name, kind in types.items() if name.endswith("norm.weight")} == {"F32"}


@pytest.mark.oracle
def test_whole_model_quantizer_uses_the_same_row_quantizer(tiny_llama_f32: Path, tmp_path: Path) -> None:
    quantized = oracle.quantize_gguf(tiny_llama_f32, tmp_path / "q4_0.gguf", "Q4_0", pure=True)
    assert set(matrices(tensor_types(quantized)).values()) == {"Q4_0"}
    source = {tensor.name: tensor for tensor in gguf.GGUFReader(tiny_llama_f32).tensors}
    target = {tensor.name: tensor for tensor in gguf.GGUFReader(quantized).tensors}
    weights = np.asarray(source["blk.1.ffn_down.weight"].data, dtype=np.float32)
    raw = np.asarray(target["blk.1.ffn_down.weight"].data)
    np.testing.assert_array_equal(raw, oracle.ggml_quantize(weights, "Q4_0"))


@pytest.mark.oracle
def test_k_quant_mix_holds_k_types(tiny_llama_f32: Path, tmp_path: Path) -> None:
    types = matrices(tensor_types(oracle.quantize_gguf(tiny_llama_f32, tmp_path / "q4_k_m.gguf", "Q4_K_M")))
    assert types["blk.0.attn_q.weight"] == "Q4_K"
    assert set(types.values()) <= {"Q4_K", "Q5_K", "Q6_K", "Q8_0"}
    assert "Q6_K" in types.values()  # Q4_K_M keeps some tensors (ffn_down, output) at 6 bits


def transformers_logits(model_dir: Path, tokens: list[int]) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0]
    return logits.numpy()


@pytest.mark.oracle
# llama and the MoE here; every family's llama.cpp logits are checked against qscheme's in test_gguf_llamacpp.py
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_tiny_model_logits_match_transformers(family: str, tmp_path: Path) -> None:
    model_dir = oracle.tiny_model(family, tmp_path / family, seed=5)
    model_gguf = oracle.convert_hf_to_gguf(model_dir, tmp_path / "model.gguf", "f32")
    names = set(tensor_types(model_gguf))
    if family == "qwen3_moe":
        assert {"blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight", "blk.0.ffn_down_exps.weight"} <= names
    tokens = [0, 17, 200, 5, 99, 42, 250, 3]
    logits = oracle.llamacpp_logits(model_gguf, tokens)
    expected = transformers_logits(model_dir, tokens)
    assert logits.shape == expected.shape == (len(tokens), expected.shape[1])
    assert np.isfinite(logits).all()
    scale = np.abs(expected).max()
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-3 * scale)


def test_ci_runs_the_llamacpp_oracle() -> None:
    """In CI the llama.cpp oracle must be there (scripts/test.sh builds and exports it): fail, never skip."""
    if not os.environ.get("CI"):
        pytest.skip("outside CI the llama.cpp oracle is optional (bash scripts/oracle-venv.sh llamacpp)")
    assert os.environ.get(oracle.ENV), f"CI is set but {oracle.ENV} is not: scripts/test.sh exports it"
