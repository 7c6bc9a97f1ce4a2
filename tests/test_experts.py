"""QuantExperts: a tiny Qwen3-MoE with random weights, quantized per expert, loaded and run.

The checkpoints are written here as compressed-tensors writes MoE models: one linear per expert
and projection (``mlp.experts.<e>.gate_proj``...), each quantized with ``quantize_weight``
(compressed-tensors' arithmetic) and the config from compressed-tensors' own
``QuantizationConfig``. The reference model takes every weight as compressed-tensors itself
decompresses it (``library_dequantize``); the loaded model must give its logits.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest
import torch
from checkpoint_cache import scratch_root, single_threaded_torch  # noqa: F401
from checkpoint_factory import library_dequantize
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
from safetensors.torch import save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from qscheme.checkpoint.inspect import inspect_checkpoint, render_inspection
from qscheme.checkpoint.model import apply_to_model
from qscheme.checkpoint.resolve import render_checkpoint_resolution, resolve_checkpoint
from qscheme.errors import CheckpointError, UsageError
from qscheme.modules import QuantExperts, QuantLinear, find_expert_modules
from qscheme.quantize import quantize_weight

EXPERTS = 8
HIDDEN = 128  # W4A16's groups are 128 wide, and compressed-tensors decompresses whole groups only
INNER = 128
FORMATS = {"NVFP4A16": "nvfp4-pack-quantized", "W4A16": "pack-quantized"}
# float32 models on both sides: only summation order differs (observed <= 2e-7 on logits ~0.5)
ATOL = 1e-5


def tiny_moe_config() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=96,
        hidden_size=HIDDEN,
        intermediate_size=96,
        moe_intermediate_size=INNER,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=64,
        tie_word_embeddings=False,
        norm_topk_prob=True,
    )


def build_moe(seed: int = 0) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(tiny_moe_config()).eval()


def write_moe_checkpoint(
    folder: Path, preset: str, *, skip: tuple[str, ...] = (), quantize_experts: bool = True
) -> Path:
    """The tiny Qwen3-MoE (seed 0) as a compressed-tensors checkpoint of ``preset`` with per-expert
    tensors; ``skip`` leaves those checkpoint modules out; ``quantize_experts=False`` stores the
    experts' weights unquantized (and ignored)."""
    folder.mkdir(parents=True, exist_ok=True)
    model = build_moe()
    scheme = f"compressed-tensors/{preset}"
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    tensors: dict[str, torch.Tensor] = {}

    def put(module: str, weight: torch.Tensor, quantize: bool = True) -> None:
        if module in skip:
            return
        if not quantize:
            tensors[f"{module}.weight"] = weight.contiguous()
            return
        for key, value in quantize_weight(weight.contiguous(), scheme).items():
            tensors[f"{module}.{key}"] = value

    for name, value in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if leaf == "gate_up_proj":
            for e in range(value.shape[0]):
                put(f"{module}.{e}.gate_proj", value[e, :INNER], quantize_experts)
                put(f"{module}.{e}.up_proj", value[e, INNER:], quantize_experts)
        elif leaf == "down_proj" and value.dim() == 3:
            for e in range(value.shape[0]):
                put(f"{module}.{e}.down_proj", value[e], quantize_experts)
        elif module in linears and leaf == "weight":
            put(module, value)
        else:
            tensors[name] = value.contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    model.config.save_pretrained(str(folder))
    ignore = ["lm_head", "re:.*mlp.gate$"] + ([] if quantize_experts else ["re:.*mlp.experts.*"])
    quantization = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
        ignore=ignore,
        format=FORMATS[preset],
        quantization_status="compressed",
    )
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization.to_dict()
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


@functools.cache
def cached_moe_checkpoint(preset: str) -> Path:
    """The tiny MoE checkpoint of ``preset``, written once per test session (do not modify it)."""
    return write_moe_checkpoint(scratch_root() / f"qwen3-moe-{preset}", preset)


@pytest.fixture(params=sorted(FORMATS))
def moe_checkpoint(request: pytest.FixtureRequest) -> Path:
    return cached_moe_checkpoint(request.param)


@pytest.fixture
def nvfp4_checkpoint() -> Path:
    return cached_moe_checkpoint("NVFP4A16")


def library_reference(folder: Path) -> Qwen3MoeForCausalLM:
    """The tiny MoE with every quantized weight as compressed-tensors decompresses it."""
    model = build_moe(seed=1)  # different random values: everything must come from the checkpoint
    state = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            state[f"{name}.weight"] = library_dequantize(folder, name)
        elif type(module).__name__ == "Qwen3MoeExperts":
            gate_up, down = [], []
            for e in range(EXPERTS):
                gate = library_dequantize(folder, f"{name}.{e}.gate_proj")
                up = library_dequantize(folder, f"{name}.{e}.up_proj")
                gate_up.append(torch.cat([gate, up]))
                down.append(library_dequantize(folder, f"{name}.{e}.down_proj"))
            state[f"{name}.gate_up_proj"] = torch.stack(gate_up)
            state[f"{name}.down_proj"] = torch.stack(down)
    original = build_moe(seed=0).state_dict()
    state.update({key: value for key, value in original.items() if key not in state and "experts" not in key})
    model.load_state_dict(state, strict=True)
    return model


TOKENS = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(3))


def _expert_layers(model: torch.nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, QuantLinear) and ".experts." in name]


def test_find_expert_modules_lists_each_fused_experts_module_with_its_shapes() -> None:
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(tiny_moe_config())
    specs = find_expert_modules(model)
    assert list(specs) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    spec = specs["model.layers.0.mlp.experts"]
    assert (spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.problem) == (EXPERTS, HIDDEN, INNER, None)
    assert spec.module_type == "Qwen3MoeExperts"
    assert spec.split("model.layers.0.mlp.experts.7.down_proj") == (7, "down_proj")
    assert spec.split("model.layers.0.mlp.gate") is None
    assert len(spec.layer_names()) == 3 * EXPERTS


@pytest.mark.parametrize("kernel", ["reference", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_every_expert_is_quantized_and_logits_equal_the_libraries_dequantized_model(
    moe_checkpoint: Path, kernel: str
) -> None:
    if kernel == "triton" and os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("the Triton kernel needs CUDA or TRITON_INTERPRET=1")
    model = build_moe(seed=2)
    apply_to_model(model, moe_checkpoint, kernel=kernel)
    experts = [module for module in model.modules() if isinstance(module, QuantExperts)]
    assert len(experts) == 2
    assert not any(isinstance(p, torch.nn.Parameter) and p.dim() == 3 for p in model.parameters())
    names = _expert_layers(model)
    assert len(names) == 2 * EXPERTS * 3
    assert {model.get_submodule(name).kernel.name for name in names} == {kernel}
    with torch.no_grad():
        logits = model(TOKENS).logits
        expected = library_reference(moe_checkpoint)(TOKENS).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=ATOL)


def test_routing_matches_the_module_it_replaces_including_expert_parallel_padding(nvfp4_checkpoint: Path) -> None:
    model = build_moe(seed=2)
    apply_to_model(model, nvfp4_checkpoint)
    quantized = model.model.layers[0].mlp.experts
    assert isinstance(quantized, QuantExperts)
    original = build_moe(seed=4).model.layers[0].mlp.experts
    gate_up, down = quantized.dequantized()
    with torch.no_grad():
        original.gate_up_proj.copy_(gate_up)
        original.down_proj.copy_(down)
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(11, HIDDEN, generator=generator)
    index = torch.randint(0, EXPERTS, (11, 2), generator=generator)
    index[3, 1] = EXPERTS  # transformers' expert-parallel padding: skipped
    index[4] = torch.tensor([5, 5])  # one expert twice for a token: counted twice
    weights = torch.rand(11, 2, generator=generator)
    unpadded = index.clamp(max=EXPERTS - 1)
    with torch.no_grad():
        # transformers' default implementation (grouped_mm here) has no padding to skip
        assert original.config._experts_implementation != "eager"
        expected = original(hidden, unpadded, weights)
        torch.testing.assert_close(quantized(hidden, unpadded, weights), expected, rtol=0, atol=1e-6)
        original.config._experts_implementation = "eager"  # the module's own loop, which skips padding
        expected = original(hidden, index, weights)
        torch.testing.assert_close(quantized(hidden, index, weights), expected, rtol=0, atol=1e-6)
        assert not torch.equal(expected[3], original(hidden, unpadded, weights)[3])  # the padding mattered
        assert torch.equal(quantized(hidden[:0], index[:0], weights[:0]), hidden[:0])


def test_an_expert_missing_from_the_checkpoint_raises_and_leaves_the_model_unchanged(tmp_path: Path) -> None:
    folder = write_moe_checkpoint(tmp_path, "NVFP4A16", skip=("model.layers.1.mlp.experts.5.up_proj",))
    model = build_moe(seed=2)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.5\.up_proj") as caught:
        apply_to_model(model, folder)
    assert "Every expert must be quantized" in str(caught.value)
    assert not any(isinstance(module, QuantLinear | QuantExperts) for module in model.modules())
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())


def test_unquantized_per_expert_weights_are_stacked_into_the_fused_parameters(tmp_path: Path) -> None:
    folder = write_moe_checkpoint(tmp_path, "W4A16", quantize_experts=False)
    model = build_moe(seed=2)
    apply_to_model(model, folder)
    assert not any(isinstance(module, QuantExperts) for module in model.modules())
    original = build_moe(seed=0).model.layers[1].mlp.experts
    assert torch.equal(model.model.layers[1].mlp.experts.gate_up_proj, original.gate_up_proj)
    assert torch.equal(model.model.layers[1].mlp.experts.down_proj, original.down_proj)


def test_empty_then_load_tensors_equals_the_loaded_module(nvfp4_checkpoint: Path) -> None:
    from safetensors.torch import load_file

    loaded = build_moe(seed=2)
    apply_to_model(loaded, nvfp4_checkpoint)
    scheme = "compressed-tensors/NVFP4A16"
    with torch.device("meta"):
        meta_model = Qwen3MoeForCausalLM(tiny_moe_config())
    spec = find_expert_modules(meta_model)["model.layers.1.mlp.experts"]
    experts = QuantExperts.empty(spec, meta_model.model.layers[1].mlp.experts.act_fn)
    with pytest.raises(CheckpointError, match="have no quantized layer"):
        experts.require_complete()
    tensors = load_file(str(nvfp4_checkpoint / "model.safetensors"))
    experts.load_tensors(
        scheme,
        {k: v.clone() for k, v in tensors.items() if k.startswith(spec.checkpoint_prefix)},
        activation_dtype=torch.float32,
    )
    experts.require_complete()
    hidden = torch.randn(5, HIDDEN)
    index = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [7, 0]])
    weights = torch.full((5, 2), 0.5)
    with torch.no_grad():
        expected = loaded.model.layers[1].mlp.experts(hidden, index, weights)
        assert torch.equal(experts(hidden, index, weights), expected)


def test_wrong_shapes_and_names_raise_typed_errors(nvfp4_checkpoint: Path) -> None:
    model = build_moe(seed=2)
    apply_to_model(model, nvfp4_checkpoint)
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, QuantExperts)
    down = experts.expert(0).down_proj
    assert down is not None
    with pytest.raises(CheckpointError, match=r"need \[256, 128\]"):
        experts.set_layer("1.gate_up_proj", down)
    with pytest.raises(CheckpointError, match="expert 8 does not exist"):
        experts.set_layer("8.down_proj", down)
    with pytest.raises(CheckpointError, match="not an expert projection"):
        experts.set_layer("0.fc1", down)
    with pytest.raises(UsageError, match=r"hidden_states must be \[tokens, 128\]"):
        experts(torch.zeros(2, 3), torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2))
    with pytest.raises(CheckpointError, match="already a QuantLinear"):
        apply_to_model(model, nvfp4_checkpoint)


def test_inspect_and_resolve_show_each_layers_experts_as_one_row(moe_checkpoint: Path) -> None:
    text = render_inspection(inspect_checkpoint(moe_checkpoint))
    assert f"model.layers.*.mlp.experts.{{0..{EXPERTS - 1}}}.gate_proj" in text
    row = next(line for line in text.splitlines() if "experts.{0..7}.down_proj" in line)
    assert row.split()[-1] == str(2 * EXPERTS)  # both layers' eight experts
    resolved = render_checkpoint_resolution(str(moe_checkpoint), resolve_checkpoint(moe_checkpoint)[1])
    rows = [line for line in resolved.splitlines() if ".experts." in line]
    assert len(rows) == 3 and all("{0..7}" in line for line in rows)
