"""compressed-tensors interop: checkpoints written by the library load exactly.

For every built-in compressed-tensors scheme: the dequantized weights are bit-identical to the
library's own decompression (its float32 path; for bf16 models also its bf16 result), and each
layer's output matches the library's fake-quantized forward (activation quantization included)
on the same input. Tolerance: float32 models, max |ours - theirs| <= 1e-6 x max |theirs| (the
two sides differ only in float32 summation order). bf16 models are compared on weights only:
in bf16 the library's forward rounds differently (peers.md).
"""

from __future__ import annotations

import pytest
import torch
from checkpoint_cache import (
    ct_checkpoint,
    single_threaded_torch,  # noqa: F401  (autouse)
)
from checkpoint_factory import CT_PRESETS, library_dequantize
from safetensors.torch import load_file

from qscheme.checkpoint import load_checkpoint

FORWARD_TOLERANCE = 1e-6


@pytest.mark.parametrize("preset", CT_PRESETS)
def test_float32_model_weights_bit_identical_and_outputs_match(preset: str) -> None:
    folder = ct_checkpoint(preset)
    checkpoint = load_checkpoint(folder, kernel="reference", activation_dtype="float32")
    reference = load_file(str(folder / "reference.safetensors"))
    assert len(checkpoint) == 7
    for name, layer in checkpoint.items():
        assert torch.equal(layer.dequantize(), library_dequantize(folder, name)), name
        x, expected = reference[f"{name}.input"], reference[f"{name}.output"]
        error = float((layer(x) - expected).abs().max())
        assert error <= FORWARD_TOLERANCE * float(expected.abs().max()), (name, error)


@pytest.mark.parametrize("preset", CT_PRESETS)
def test_bfloat16_model_weights_bit_identical(preset: str) -> None:
    folder = ct_checkpoint(preset, "bfloat16")
    checkpoint = load_checkpoint(folder, kernel="reference")
    for name, layer in checkpoint.items():
        ours = layer.dequantize()
        assert torch.equal(ours, library_dequantize(folder, name)), name
        theirs_bf16 = library_dequantize(folder, name, float32_path=False)
        assert torch.equal(ours.to(torch.bfloat16).to(torch.float32), theirs_bf16), name


def test_nvfp4_qkv_global_scales_differ_and_load_exactly() -> None:
    folder = ct_checkpoint("NVFP4")
    checkpoint = load_checkpoint(folder, kernel="reference")
    scales = {
        name: float(checkpoint.canonical(f"model.layers.0.self_attn.{name}").global_scale[0])  # type: ignore[index]
        for name in ("q_proj", "k_proj", "v_proj")
    }
    assert len(set(scales.values())) == 3, scales
    for name in scales:
        module = f"model.layers.0.self_attn.{name}"
        assert torch.equal(checkpoint[module].dequantize(), library_dequantize(folder, module))


def test_sharded_checkpoint_loads_like_the_single_file() -> None:
    single = load_checkpoint(ct_checkpoint("W4A16_ASYM"), kernel="reference")
    sharded = load_checkpoint(ct_checkpoint("W4A16_ASYM", max_shard_size="100KB"), kernel="reference")
    assert len(sharded.report.files) > 1
    assert list(single) == list(sharded)
    for name in single:
        assert torch.equal(single[name].dequantize(), sharded[name].dequantize())
    assert set(single.tensors) == set(sharded.tensors)


def test_regex_targets_and_quantized_lm_head() -> None:
    folder = ct_checkpoint("FP8_DYNAMIC", targets=("re:.*self_attn\\.(q|k|v)_proj$", "re:^lm_head$"), ignore=())
    checkpoint = load_checkpoint(folder, kernel="reference", activation_dtype="float32")
    assert sorted(checkpoint) == sorted(["lm_head", *[f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]])
    assert torch.equal(checkpoint["lm_head"].dequantize(), library_dequantize(folder, "lm_head"))
    assert "model.layers.0.mlp.up_proj.weight" in checkpoint.tensors
    reference = load_file(str(folder / "reference.safetensors"))
    expected = reference["lm_head.output"]
    assert float((checkpoint["lm_head"](reference["lm_head.input"]) - expected).abs().max()) <= 1e-6 * float(
        expected.abs().max()
    )
