"""compressed-tensors checkpoints through the opt-in route (``via_qscheme``), against
transformers' own compressed-tensors quantizer on the same checkpoint (written by the library).

What transformers 5.24's own route does on a CPU decides what can be compared:
- FP8_DYNAMIC and W4A16 (float32 models): it runs the library's modules; logits must agree to
  1e-5 of their largest magnitude (float32 summation order only).
- NVFP4A16 / NVFP4: with ``run_compressed=False`` it decompresses the weights, rounding them to
  bf16 even in a float32 model, and it drops NVFP4's input quantization (``input_global_scale``
  is reported unexpected). So: its decompressed weights must equal ours rounded to bf16, bit for
  bit, and for the weight-only NVFP4A16 the bf16 models' logits must agree to bf16 rounding.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from checkpoint_cache import ct_checkpoint
from checkpoint_factory import library_dequantize

from qscheme.errors import UsageError
from qscheme.modules import QuantLinear
from qscheme.transformers import via_qscheme

INPUT_IDS = torch.tensor([[1, 5, 9, 200, 33, 7, 100, 2]])
FLOAT32_LOGITS = 1e-5  # relative to max |logit|: float32 summation order only
BF16_LOGITS = 2e-2  # relative to max |logit|: bf16 activations, summation order differs


def _ours(folder: object, **kwargs: object) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, config=via_qscheme(folder), **kwargs).eval()


def _theirs(folder: object, **kwargs: object) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(INPUT_IDS).logits.float()


def _quantized(model: torch.nn.Module) -> dict[str, QuantLinear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, QuantLinear)}


@pytest.mark.parametrize("preset", ["FP8_DYNAMIC", "W4A16"])
def test_logits_equal_transformers_compressed_tensors_route(preset: str) -> None:
    folder = ct_checkpoint(preset)
    ours, theirs = _ours(folder), _theirs(folder)
    assert len(_quantized(ours)) == 7 and not _quantized(theirs)
    expected = _logits(theirs)
    error = float((_logits(ours) - expected).abs().max())
    assert error <= FLOAT32_LOGITS * float(expected.abs().max()), error


@pytest.mark.parametrize("preset", ["NVFP4A16", "NVFP4"])
def test_nvfp4_weights_equal_the_routes_decompression(preset: str) -> None:
    from transformers import CompressedTensorsConfig

    folder = ct_checkpoint(preset)
    ours = _ours(folder)
    theirs = _theirs(folder, quantization_config=CompressedTensorsConfig(run_compressed=False))
    layers = _quantized(ours)
    assert len(layers) == 7
    for name, layer in layers.items():
        their_weight = theirs.get_submodule(name).weight.detach()
        assert torch.equal(layer.dequantize().to(torch.bfloat16).float(), their_weight.float()), name


def test_nvfp4a16_bf16_logits_agree_with_transformers_compressed_tensors_route() -> None:
    from transformers import CompressedTensorsConfig

    folder = ct_checkpoint("NVFP4A16")
    ours = _ours(folder, dtype=torch.bfloat16)
    config = CompressedTensorsConfig(run_compressed=False)
    theirs = _theirs(folder, dtype=torch.bfloat16, quantization_config=config)
    expected = _logits(theirs)
    error = float((_logits(ours) - expected).abs().max())
    assert error <= BF16_LOGITS * float(expected.abs().max()), error


def test_w4a16_layers_equal_the_librarys_decompression() -> None:
    folder = ct_checkpoint("W4A16")
    layers = _quantized(_ours(folder))
    assert len(layers) == 7
    for name, layer in layers.items():
        assert torch.equal(layer.dequantize(), library_dequantize(folder, name)), name


def test_the_default_route_stays_transformers_own() -> None:
    folder = ct_checkpoint("FP8_DYNAMIC")
    theirs = _theirs(folder)
    assert type(theirs.hf_quantizer).__module__.startswith("transformers.")
    config = via_qscheme(folder)
    assert config.quantization_config["quant_method"] == "qscheme-compressed-tensors"


def test_via_qscheme_refuses_an_unquantized_folder(tmp_path: object) -> None:
    from transformers import LlamaConfig

    folder = tmp_path / "plain"  # type: ignore[operator]
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, vocab_size=64).save_pretrained(folder)
    with pytest.raises(UsageError, match="quant_method None"):
        via_qscheme(folder)
