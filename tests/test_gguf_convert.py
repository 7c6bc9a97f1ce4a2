"""GGUF <-> compressed-tensors / ModelOpt where the codes are shared (qscheme.writing.gguf_*).

The oracle for values is gguf-py's own dequantizer (``gguf.quants.dequantize``) and, for whole
files, transformers' GGUF loader (``gguf_tiny.reference_state``): a converted layer must
dequantize to exactly what they give, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf_tiny import reference_state, uniform, write_tiny_gguf  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from qscheme.canonical import canonicalize, dequantize  # noqa: E402
from qscheme.catalog import load_scheme  # noqa: E402
from qscheme.cli.main import main  # noqa: E402
from qscheme.errors import QSchemeError  # noqa: E402
from qscheme.writing.convert_layer import RequantizationRefusedError, UnconvertibleLayerError  # noqa: E402
from qscheme.writing.gguf_codes import block_codes  # noqa: E402
from qscheme.writing.gguf_convert import convert_gguf  # noqa: E402
from qscheme.writing.gguf_layer import blocks_to_layer, layer_to_blocks  # noqa: E402

N, K = 48, 256
PAIRS = {
    "Q4_0": "compressed-tensors/W4A16_G32",
    "Q8_0": "compressed-tensors/W8A16_G32",
    "MXFP4": "compressed-tensors/MXFP4A16",
    "NVFP4": "modelopt/W4A16_NVFP4",
}


def _nvfp4_blocks(rows: int, k: int, seed: int) -> np.ndarray:
    """Random NVFP4 blocks (gguf-py cannot quantize NVFP4): 4 ue4m3 scale bytes below 0x7F, then
    32 bytes of e2m1 codes, per 64 weights."""
    generator = np.random.default_rng(seed)
    blocks = generator.integers(0, 256, size=(rows * k // 64, 36), dtype=np.uint8)
    blocks[:, :4] = generator.integers(0x20, 0x50, size=(blocks.shape[0], 4), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def _blocks(kind: str, rows: int = N, k: int = K, seed: int = 0) -> np.ndarray:
    if kind == "NVFP4":
        return _nvfp4_blocks(rows, k, seed)
    weights = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32)
    weights[0, :32] = 0.0  # an all-zero block: a zero scale
    return gguf.quants.quantize(weights, gguf.GGMLQuantizationType[kind])


def _gguf_values(raw: np.ndarray, kind: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).astype(np.float32))


@pytest.mark.parametrize("kind", sorted(PAIRS))
def test_shared_codes_convert_exactly_and_back(kind: str) -> None:
    raw = _blocks(kind)
    source, target = load_scheme(f"gguf/{kind}"), load_scheme(PAIRS[kind])
    result = blocks_to_layer("m", source, torch.from_numpy(raw), N, K, target)
    assert result.action == "converted"
    assert (result.max_ulps, result.max_abs_error) == (0, 0.0)
    converted = dequantize(canonicalize(target, result.tensors, N, K))
    expected = _gguf_values(raw, kind)
    assert torch.equal(converted.view(torch.int32), expected.view(torch.int32))  # bit for bit, -0 included
    back, report = layer_to_blocks("m", target, result.tensors, N, K, source)
    assert report.action == "converted" and report.max_ulps == 0
    assert np.array_equal(back.numpy(), raw)


def test_q4_0_codes_are_q_minus_8_and_scale_is_the_fp16_d() -> None:
    raw = _blocks("Q4_0", rows=1, k=32, seed=3)
    d = raw[0, :2].copy().view(np.float16)[0]
    nibbles = raw[0, 2:18]
    q = np.concatenate([nibbles & 0xF, nibbles >> 4]).astype(np.int64)  # llama.cpp: low nibbles first
    result = blocks_to_layer("m", load_scheme("gguf/Q4_0"), torch.from_numpy(raw), 1, 32, load_scheme(PAIRS["Q4_0"]))
    scale = result.tensors["weight_scale"]
    assert scale.dtype == torch.float16 and scale.item() == float(d)
    packed = result.tensors["weight_packed"].numpy().view(np.uint32)[0]
    stored = [(int(packed[i // 8]) >> (4 * (i % 8))) & 0xF for i in range(32)]  # compressed-tensors: +8 offset
    assert stored == q.tolist()


def test_ue4m3_0x7f_and_top_bit_keep_their_value() -> None:
    raw = _nvfp4_blocks(1, 64, seed=5)
    raw[0, 0], raw[0, 1] = 0x7F, 0x80 | 0x38  # 0x7F reads as 0; the top bit is ignored
    source, target = load_scheme("gguf/NVFP4"), load_scheme(PAIRS["NVFP4"])
    result = blocks_to_layer("m", source, torch.from_numpy(raw), 1, 64, target)
    assert result.max_ulps == 0
    scale = result.tensors["weight_scale"].view(torch.uint8)[0]
    assert scale[0].item() == 0x00 and scale[1].item() == 0x38
    assert float(result.tensors["weight_scale_2"].reshape(-1)[0]) == 1.0


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K", "Q6_K", "IQ4_NL"])
def test_types_without_shared_codes_are_not_code_and_scale(kind: str) -> None:
    assert isinstance(block_codes(load_scheme(f"gguf/{kind}")), str)


def test_other_targets_are_refused_unless_requantize() -> None:
    raw = torch.from_numpy(_blocks("Q4_0"))
    source, target = load_scheme("gguf/Q4_0"), load_scheme("compressed-tensors/W4A16")
    with pytest.raises(RequantizationRefusedError) as error:
        blocks_to_layer("model.layers.0.mlp.up_proj", source, raw, N, K, target)
    message = str(error.value)
    assert "model.layers.0.mlp.up_proj" in message and "weight group size: 32 -> 128" in message
    assert "compressed-tensors/W4A16_G32" in message and "--allow-requantize" in message
    result = blocks_to_layer("m", source, raw, N, K, target, allow_requantize=True)
    assert result.action == "requantized"
    assert result.relative_error is not None and 0 < result.relative_error < 0.2


def test_a_target_with_static_input_scales_is_unconvertible() -> None:
    raw = torch.from_numpy(_blocks("NVFP4"))
    with pytest.raises(UnconvertibleLayerError, match="input_scale"):
        blocks_to_layer("m", load_scheme("gguf/NVFP4"), raw, N, K, load_scheme("modelopt/NVFP4"), allow_requantize=True)


def test_reverse_refuses_a_global_scale_other_than_one() -> None:
    raw = torch.from_numpy(_blocks("NVFP4"))
    source, target = load_scheme("gguf/NVFP4"), load_scheme(PAIRS["NVFP4"])
    tensors = dict(blocks_to_layer("m", source, raw, N, K, target).tensors)
    tensors["weight_scale_2"] = torch.tensor(2.0)
    with pytest.raises(RequantizationRefusedError, match=r"global scale: 2\.0"):
        layer_to_blocks("m", target, tensors, N, K, source)


# --- whole files ---------------------------------------------------------------------------------


def test_q4_0_file_converts_to_a_folder_that_dequantizes_as_transformers_reads_the_gguf(tmp_path: Path) -> None:
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", uniform("Q4_0"))
    out = tmp_path / "out"
    assert main(["convert", str(tiny.path), str(out), "--scheme", PAIRS["Q4_0"]]) == 0
    target = load_scheme(PAIRS["Q4_0"])
    tensors = load_file(str(out / "model.safetensors"))
    reference = reference_state(tiny.path)
    quantized = {name.removesuffix(".weight_packed") for name in tensors if name.endswith(".weight_packed")}
    assert "model.layers.0.self_attn.q_proj" in quantized and "lm_head" in quantized
    for module in quantized:
        layer = {short: tensors[f"{module}.{short}"] for short in ("weight_packed", "weight_scale", "weight_shape")}
        values = dequantize(canonicalize(target, layer))
        assert torch.equal(values, reference[f"{module}.weight"]), module  # q/k rows in transformers' order
    plain = set(tensors) - {name for name in tensors if name.rpartition(".")[0] in quantized}
    assert "model.embed_tokens.weight" in plain  # dequantized: not a linear layer
    for name in plain:
        assert torch.equal(tensors[name].float(), reference[name]), name
    config = (out / "config.json").read_text()
    assert '"LlamaForCausalLM"' in config and '"group_size": 32' in config


def test_mixed_file_is_refused_before_writing(tmp_path: Path) -> None:
    def mixed(name: str, shape: tuple[int, ...]) -> str:
        return "Q8_0" if ".ffn_down." in name else uniform("Q4_0")(name, shape)

    tiny = write_tiny_gguf(tmp_path / "mixed.gguf", "llama", mixed)
    out = tmp_path / "out"
    with pytest.raises(RequantizationRefusedError, match=r"mlp\.down_proj.*gguf/Q8_0"):
        convert_gguf(tiny.path, out, PAIRS["Q4_0"])
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


def test_block_target_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(QSchemeError, match="compressed-tensors/W4A16_G32"):
        convert_gguf(tmp_path / "absent.gguf", tmp_path / "out", "gguf/Q4_0")
