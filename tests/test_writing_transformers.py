"""``qscheme quantize`` output loads in the compressed-tensors library and through transformers.

For compressed-tensors NVFP4A16, W4A16, FP8_DYNAMIC and FP8 (with a calibration file), the
checkpoint qscheme writes from a small bf16 Llama-like checkpoint (tests/writing_checkpoints.py,
3 shards, fused groups straddling shards):

- compressed-tensors parses its ``quantization_config`` (``QuantizationConfig.model_validate``)
  and its own decompression of every quantized module (float32 path, see peers.md) equals the
  weight ``qscheme.load_checkpoint`` dequantizes, bit for bit;
- ``AutoModelForCausalLM.from_pretrained`` (transformers 5.24 + compressed-tensors 0.20.1) loads
  it compressed and decompressed (``CompressedTensorsConfig(dequantize=True)``) with no missing
  key, every Linear's decompressed bf16 weight equals qscheme's dequantized weight rounded to
  bf16, unquantized tensors are the source's, and both models give finite logits.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from writing_checkpoints import LlamaShape, qscheme_quantize, read_tensors, write_bf16_checkpoint

from qscheme.checkpoint import load_checkpoint

PRESETS = ("NVFP4A16", "W4A16", "FP8_DYNAMIC", "FP8")
TOKENS = torch.tensor([[1, 5, 9, 3, 200, 17]])


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("writing-transformers")
    source = root / "src"
    write_bf16_checkpoint(source)
    calibration = root / "calibration.json"
    amax = {module: 1.0 + 0.5 * i for i, module in enumerate(LlamaShape().linear_modules())}
    calibration.write_text(json.dumps({"format": "qscheme-calibration/1", "input_amax": amax}))
    outputs = {"src": source}
    for preset in PRESETS:
        extra = ("--calibration", str(calibration)) if preset == "FP8" else ()
        qscheme_quantize(source, root / preset, f"compressed-tensors/{preset}", *extra)
        outputs[preset] = root / preset
    return outputs


def library_decompress(folder: Path, module: str, tensors: dict[str, tuple[str, torch.Tensor]]) -> torch.Tensor:
    """compressed-tensors' own decompression of one module, computed in float32."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    (scheme,) = QuantizationConfig.model_validate(config).config_groups.values()
    prefix = module + "."
    state = {
        name[len(prefix) :]: value.to(torch.float32) if value.dtype == torch.bfloat16 else value
        for name, (_, value) in tensors.items()
        if name.startswith(prefix) and "." not in name[len(prefix) :]
    }
    if scheme.format == "nvfp4-pack-quantized":  # its unpacker in float32, then its dequantize
        packed = state["weight_packed"]
        values = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
        return dequantize(
            x_q=values,
            scale=state["weight_scale"].to(torch.float32),
            args=scheme.weights,
            global_scale=state["weight_global_scale"],
            dtype=torch.float32,
        )
    decompressed = BaseCompressor.get_value_from_registry(scheme.format).decompress(state, scheme)
    return decompressed["weight"].to(torch.float32)


@pytest.mark.parametrize("preset", PRESETS)
def test_compressed_tensors_decompresses_what_qscheme_dequantizes(preset: str, written: dict[str, Path]) -> None:
    folder = written[preset]
    tensors = read_tensors(folder)
    checkpoint = load_checkpoint(folder, kernel="reference")
    assert sorted(checkpoint) == sorted(LlamaShape().linear_modules())
    for module, layer in checkpoint.items():
        assert torch.equal(layer.dequantize(), library_decompress(folder, module, tensors)), module


def load_transformers(folder: Path, dequantize: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    kwargs = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if dequantize else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = AutoModelForCausalLM.from_pretrained(str(folder), output_loading_info=True, **kwargs)
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["error_msgs"], info
    unexpected = set(info["unexpected_keys"])
    # a decompressed model has no place for the static activation scales (peers.md: harmless)
    assert all(dequantize and key.endswith(".input_scale") for key in unexpected), unexpected
    model.eval()
    return model  # type: ignore[no-any-return]


@pytest.mark.parametrize("preset", PRESETS)
def test_transformers_loads_it(preset: str, written: dict[str, Path]) -> None:
    folder = written[preset]
    checkpoint = load_checkpoint(folder, kernel="reference")
    source = read_tensors(written["src"])
    decompressed = load_transformers(folder, dequantize=True)
    state = decompressed.state_dict()
    for module, layer in checkpoint.items():
        weight = state[f"{module}.weight"]
        assert weight.dtype == torch.bfloat16
        assert torch.equal(weight, layer.dequantize().to(torch.bfloat16)), module
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert torch.equal(state[name], source[name][1]), name
    compressed = load_transformers(folder, dequantize=False)
    with torch.no_grad():
        for model in (decompressed, compressed):
            logits = model(TOKENS).logits
            assert logits.shape == (1, TOKENS.shape[1], LlamaShape().vocab) and bool(logits.isfinite().all())
