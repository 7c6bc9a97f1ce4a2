"""A tiny Qwen3-MoE through ``from_pretrained`` on the opt-in compressed-tensors route.

The checkpoints are tests/test_experts.py's: the tiny Qwen3-MoE (random weights, built from its
config) written as compressed-tensors writes MoE models, one quantized linear per expert and
projection (``mlp.experts.<e>.gate_proj``...), in NVFP4A16 and W4A16. The reference model takes
every weight as compressed-tensors itself decompresses it (``library_reference``).

transformers 5.24's weight-conversion mapping for Qwen3-MoE merges ``experts.*.gate_proj/up_proj``
checkpoint tensors into the fused ``gate_up_proj``. The quantized experts' tensors must not go
through it: qscheme puts a placeholder without parameters where each experts module is, so
transformers finds no parameter for them and never reads them; qscheme reads them itself into
the QuantLinear layers of a QuantExperts. Experts the checkpoint leaves unquantized still go
through transformers' merge.

Tolerance: both models are float32 and compute the same products; only the order of float32 sums
differs (kernel blocking, expert dispatch), so logits agree to 1e-5 of their largest magnitude
(observed: 0 on the reference kernel, <= 5e-7 of ~0.9 on the Triton kernel interpreted).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from checkpoint_cache import single_threaded_torch  # noqa: F401
from test_experts import (
    EXPERTS,
    FORMATS,
    TOKENS,
    build_moe,
    cached_moe_checkpoint,
    library_reference,
    write_moe_checkpoint,
)

from qscheme.errors import CheckpointError
from qscheme.modules import QuantExperts, QuantLinear
from qscheme.transformers import via_qscheme

PRESETS = ("NVFP4A16", "W4A16")
LOGITS = 1e-5  # relative to max |logit|: float32 summation order only
EXPERTS_MODULES = ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")


def _load(folder: Path, kernel: str | None = None) -> tuple[torch.nn.Module, dict[str, object]]:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        folder, config=via_qscheme(folder, kernel=kernel), output_loading_info=True
    )
    return model.eval(), info


@functools.cache
def _expected_logits(preset: str) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = library_reference(cached_moe_checkpoint(preset))(TOKENS).logits
    return logits


def _skip_without_triton(kernel: str) -> None:
    if kernel == "triton" and os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("the Triton kernel needs CUDA or TRITON_INTERPRET=1")


@pytest.mark.parametrize("kernel", ["reference", pytest.param("triton", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("preset", PRESETS)
def test_every_expert_is_a_quantlinear_in_a_quantexperts_and_logits_equal_the_dequantized_reference(
    preset: str, kernel: str
) -> None:
    _skip_without_triton(kernel)
    model, info = _load(cached_moe_checkpoint(preset), kernel)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
    assert info["mismatched_keys"] == set(), info
    experts = {name: module for name, module in model.named_modules() if isinstance(module, QuantExperts)}
    assert list(experts) == list(EXPERTS_MODULES)
    assert not any(parameter.dim() == 3 for parameter in model.parameters())  # no fused float experts left
    for module in experts.values():
        layers = dict(module.layers())
        assert len(layers) == 3 * EXPERTS
        for layer_name, layer in layers.items():
            assert model.get_submodule(layer_name) is layer, layer_name  # named as in the checkpoint
            assert layer.kernel.name == kernel and layer.scheme.name == f"compressed-tensors/{preset}", layer_name
    all_expert_layers = [n for n, m in model.named_modules() if isinstance(m, QuantLinear) and ".experts." in n]
    assert len(all_expert_layers) == 2 * 3 * EXPERTS  # every expert of both layers, and nothing else
    with torch.no_grad():
        logits = model(TOKENS).logits
    expected = _expected_logits(preset)
    error = float((logits - expected).abs().max())
    assert error <= LOGITS * float(expected.abs().max()), error


def test_the_quantized_experts_tensors_bypass_the_weight_conversion_mapping(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """FP8 stores each expert's codes as ``<e>.gate_proj.weight``: exactly what the merge matches."""
    import re

    from safetensors import safe_open
    from transformers import core_model_loading
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    monkeypatch.setitem(FORMATS, "FP8_DYNAMIC", "float-quantized")
    folder = write_moe_checkpoint(tmp_path / "fp8", "FP8_DYNAMIC")
    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        keys = set(handle.keys())
    expert_keys = {key for key in keys if ".mlp.experts." in key}
    assert len(expert_keys) == 2 * 3 * EXPERTS * 2  # weight (float8) and weight_scale
    # the mapping this is about merges them into the fused gate_up_proj / down_proj
    merges = [c for c in get_checkpoint_conversion_mapping("qwen3_moe") if "experts" in str(c.target_patterns)]
    patterns = [re.compile(p.replace(".", r"\.").replace("*", r"\d+")) for c in merges for p in c.source_patterns]
    assert any(p.search("model.layers.0.mlp.experts.3.gate_proj.weight") for p in patterns), merges
    taken: list[str] = []
    original = core_model_loading.WeightTransform.add_tensor

    def record(self: object, target_key: str, source_key: str, *args: object) -> None:
        taken.append(source_key)
        original(self, target_key, source_key, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(core_model_loading.WeightTransform, "add_tensor", record)
    model, info = _load(folder)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
    assert taken, "transformers loaded nothing: the recorder no longer sees its loading"
    assert not expert_keys & set(taken), sorted(expert_keys & set(taken))[:5]
    assert set(taken) == keys - expert_keys - {k for k in keys if k.endswith(("_proj.weight", "_proj.weight_scale"))}
    layer = model.get_submodule("model.layers.1.mlp.experts.7.gate_proj")
    assert isinstance(layer, QuantLinear) and layer.scheme.name == "compressed-tensors/FP8_DYNAMIC"
    assert sum(isinstance(module, QuantExperts) for module in model.modules()) == 2


def test_unquantized_experts_still_go_through_transformers_merge(tmp_path: Path) -> None:
    folder = write_moe_checkpoint(tmp_path / "plain-experts", "NVFP4A16", quantize_experts=False)
    model, info = _load(folder)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
    assert not any(isinstance(module, QuantExperts) for module in model.modules())
    assert isinstance(model.get_submodule("model.layers.0.self_attn.q_proj"), QuantLinear)
    original = build_moe(seed=0)
    for name in EXPERTS_MODULES:
        for parameter in ("gate_up_proj", "down_proj"):
            ours = model.get_submodule(name).get_parameter(parameter)
            assert torch.equal(ours, original.get_submodule(name).get_parameter(parameter)), (name, parameter)


def test_an_expert_missing_from_the_checkpoint_is_refused_before_anything_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import core_model_loading

    missing = "model.layers.1.mlp.experts.5.up_proj"
    folder = write_moe_checkpoint(tmp_path / "incomplete", "NVFP4A16", skip=(missing,))
    taken: list[str] = []
    monkeypatch.setattr(core_model_loading.WeightTransform, "add_tensor", lambda self, *args: taken.append(args[1]))
    with pytest.raises(CheckpointError, match=rf"{missing}.*Every expert must be quantized"):
        _load(folder)
    assert taken == []  # refused while planning: transformers read no tensor


def test_experts_the_model_does_not_have_are_refused_before_anything_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json
    import shutil

    from transformers import core_model_loading

    folder = tmp_path / "fewer-experts"
    shutil.copytree(cached_moe_checkpoint("NVFP4A16"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["num_local_experts"] = 4  # what Qwen3MoeConfig saves num_experts as
    (folder / "config.json").write_text(json.dumps(config))
    taken: list[str] = []
    monkeypatch.setattr(core_model_loading.WeightTransform, "add_tensor", lambda self, *args: taken.append(args[1]))
    with pytest.raises(CheckpointError, match=r"experts\.4\.\w+_proj.*has 4 experts \(0\.\.3\)"):
        _load(folder)
    assert taken == []  # refused while planning: transformers read no tensor
