"""Tiny Qwen3-MoE checkpoints (2 layers, 4 experts, top-2, hidden 128) of GPTQ (v1, 4-bit g32),
AWQ (GEMM, 4-bit g128: AWQ's one declared group), AutoRound (``auto_round:auto_gptq``, 4-bit g32)
and bitsandbytes (NF4, double quant), each written by the producer's own library
(tests/moe_oracle.py, one process per oracle venv, the two side by side: GPTQModel's
``TorchLinear.pack`` and AutoAWQ's ``WQLinear_GEMM`` packing every attention projection and every
expert's ``gate_proj``/``up_proj``/``down_proj``; AutoRound's own round-to-nearest
``quantize_and_save``; transformers' ``BitsAndBytesConfig`` and ``save_pretrained``).

For each: ``load_checkpoint`` holds every expected layer (every expert of every layer for GPTQ,
AWQ and AutoRound) bit-identical to the library's own dequantization; logits through
``apply_to_model`` and ``from_pretrained(path, config=via_qscheme(path))`` equal a dense Qwen3-MoE holding the library's
dequantized weights (experts fused as transformers holds them) within 1e-5; for bitsandbytes they
also equal transformers' own bitsandbytes loader (its dequantize-then-matmul CPU path, run in the
oracle venv). transformers' GPTQ/AWQ/AutoRound loaders need GPTQModel's / AutoAWQ's / AutoRound's
kernels, which the CPU oracle venv installs without: they are not compared.

transformers' bitsandbytes integration replaces ``nn.Linear`` modules only: the fused experts of a
transformers 5 MoE stay float in the checkpoint it writes (pinned below), and qscheme loads them so.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_cache import single_threaded_torch  # noqa: F401  (autouse)
from oracle_jobs import oracle_python, run_jobs
from safetensors.torch import load_file

pytestmark = pytest.mark.oracle  # every test here: its module's fixture runs the producers in side venvs

transformers = pytest.importorskip("transformers")

from qscheme.checkpoint import apply_to_model, load_checkpoint  # noqa: E402
from qscheme.modules import QuantExperts, QuantLinear  # noqa: E402
from qscheme.transformers import via_qscheme  # noqa: E402

ORACLE = str(Path(__file__).with_name("moe_oracle.py"))
MODEL = {
    "vocab_size": 128,
    "hidden_size": 128,
    "intermediate_size": 128,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "norm_topk_prob": True,
}
LAYERS, EXPERTS = 2, 4
ATTENTION = [f"model.layers.{i}.self_attn.{p}_proj" for i in range(LAYERS) for p in "qkvo"]
EXPERT_LAYERS = [
    f"model.layers.{i}.mlp.experts.{e}.{p}_proj"
    for i in range(LAYERS)
    for e in range(EXPERTS)
    for p in ("gate", "up", "down")
]
SCHEMES = {
    "gptq": "gptq/W4A16_G32",
    "awq": "awq/W4A16_ASYM",
    "auto_round": "gptq/W4A16_G32",  # AutoRound's auto_round:auto_gptq packing is GPTQ's v1 layout
    "bitsandbytes": "bitsandbytes/NF4_DQ",
}
PRODUCERS = sorted(SCHEMES)
TOKENS = torch.tensor([[1, 5, 9, 100, 33, 7, 64, 2]])


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-producers")
    gptq_python = oracle_python("QSCHEME_GPTQ_PYTHON", "gptq")
    bnb_python = oracle_python("QSCHEME_BITSANDBYTES_PYTHON", "bitsandbytes")
    packed = [
        {"kind": "gptq", "bits": 4, "group_size": 32, "sym": True, "checkpoint_format": "gptq", "seed": 1},
        {"kind": "awq", "bits": 4, "group_size": 128, "seed": 2},
        {"kind": "auto_round", "bits": 4, "group_size": 32, "sym": True, "seed": 4},
    ]
    jobs = [{**job, "model": MODEL, "dst": str(root / str(job["kind"]))} for job in packed]
    bnb = {"kind": "bitsandbytes", "quant_type": "nf4", "double_quant": True, "seed": 3, "model": MODEL}
    with ThreadPoolExecutor(2) as pool:  # the two oracle processes side by side
        runs = [
            pool.submit(
                run_jobs,
                ORACLE,
                jobs,
                python=gptq_python,
                label="GPTQ/AWQ/AutoRound MoE",
                extra_env={"GPTQMODEL_DISABLE_PACK_EXT": "1"},
            ),
            pool.submit(
                run_jobs,
                ORACLE,
                [{**bnb, "dst": str(root / "bitsandbytes")}],
                python=bnb_python,
                label="bitsandbytes MoE",
            ),
        ]
        for run in runs:
            run.result()
    folders = {str(job["kind"]): root / str(job["kind"]) for job in packed}
    return {**folders, "bitsandbytes": root / "bitsandbytes" / "quantized"}


def _reference_file(folders: dict[str, Path], name: str) -> Path:
    return folders[name].parent if name == "bitsandbytes" else folders[name]


def references(folder: Path) -> dict[str, torch.Tensor]:
    """The producer's dequantized weights a job wrote, keyed by module."""
    tensors = load_file(folder / "reference.safetensors")
    return {n.removesuffix(".dequantized"): v for n, v in tensors.items() if n.endswith(".dequantized")}


def _config(folder: Path) -> Any:
    config = transformers.AutoConfig.from_pretrained(folder)
    del config.quantization_config
    return config


def _dense(folder: Path, dequantized: dict[str, torch.Tensor]) -> Any:
    """A Qwen3-MoE holding the checkpoint's float tensors and the library's dequantized weights,
    per-expert weights fused into ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]."""
    tensors = load_file(folder / "model.safetensors")
    weights = {
        name: value for name, value in tensors.items() if not name.startswith(tuple(m + "." for m in dequantized))
    }
    weights.update({name + ".weight": value for name, value in dequantized.items()})
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, value in weights.items():
        if ".mlp.experts." in name:
            module, _, rest = name.partition(".experts.")
            index, projection, _ = rest.split(".")
            experts.setdefault(f"{module}.experts", {}).setdefault(int(index), {})[projection] = value
        else:
            state[name] = value
    for module, per_expert in experts.items():
        order = sorted(per_expert)
        state[f"{module}.gate_up_proj"] = torch.stack(
            [torch.cat([per_expert[e]["gate_proj"], per_expert[e]["up_proj"]]) for e in order]
        )
        state[f"{module}.down_proj"] = torch.stack([per_expert[e]["down_proj"] for e in order])
    torch.manual_seed(11)
    model = transformers.AutoModelForCausalLM.from_config(_config(folder), dtype=torch.float32)
    model.load_state_dict({n: v.float() for n, v in state.items()}, strict=True)
    model.set_experts_implementation("eager")
    return model.eval()


def _logits(model: Any, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits.float()


@pytest.mark.parametrize("name", PRODUCERS)
def test_every_layer_loads_bit_identical_to_the_producers_dequantization(folders: dict[str, Path], name: str) -> None:
    dequantized = references(_reference_file(folders, name))
    expected = ATTENTION if name == "bitsandbytes" else ATTENTION + EXPERT_LAYERS
    assert set(dequantized) == set(expected)  # what the producer quantized
    checkpoint = load_checkpoint(folders[name])
    assert set(checkpoint.modules) == set(expected)
    assert {layer.scheme.name for layer in checkpoint.modules.values()} == {SCHEMES[name]}
    for module, layer in checkpoint.modules.items():
        assert torch.equal(layer.dequantize(), dequantized[module].float()), module


def test_bitsandbytes_leaves_the_fused_experts_float(folders: dict[str, Path]) -> None:
    tensors = load_file(folders["bitsandbytes"] / "model.safetensors")
    dense = load_file(folders["bitsandbytes"].parent / "dense" / "model.safetensors")
    for name in EXPERT_LAYERS:
        assert tensors[f"{name}.weight"].dtype == torch.float32
        assert torch.equal(tensors[f"{name}.weight"], dense[f"{name}.weight"]), name
    assert not any(key.startswith(f"{EXPERT_LAYERS[0]}.weight.") for key in tensors)  # no quant state


@pytest.mark.parametrize("name", PRODUCERS)
def test_logits_through_apply_to_model_and_from_pretrained_equal_the_dense_model(
    folders: dict[str, Path], name: str
) -> None:
    folder = folders[name]
    reference_folder = _reference_file(folders, name)
    dequantized = references(reference_folder)
    tokens = load_file(reference_folder / "reference.safetensors")["input_ids"] if name == "bitsandbytes" else TOKENS
    expected = _logits(_dense(folder, dequantized), tokens)
    torch.manual_seed(12)  # another random init than the dense model's: a weight left at it would show
    applied = transformers.AutoModelForCausalLM.from_config(_config(folder), dtype=torch.float32).eval()
    apply_to_model(applied, folder, kernel="reference")
    # float32 as the dense model: AutoRound stores its float tensors in bfloat16, which transformers'
    # default dtype ("auto") would keep
    routed = transformers.AutoModelForCausalLM.from_pretrained(
        folder, config=via_qscheme(folder, kernel="reference"), dtype=torch.float32
    )
    for model in (applied, routed.eval()):
        assert isinstance(model.get_submodule("model.layers.1.self_attn.o_proj"), QuantLinear)
        experts = model.get_submodule("model.layers.1.mlp.experts")
        if name == "bitsandbytes":
            assert not isinstance(experts, QuantExperts)
        else:
            assert isinstance(experts, QuantExperts)
            assert isinstance(experts.get_submodule(f"{EXPERTS - 1}.down_proj"), QuantLinear)
        logits = _logits(model, tokens)
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
        if name == "bitsandbytes":  # transformers' own bitsandbytes loader, in the oracle venv
            theirs = load_file(reference_folder / "reference.safetensors")["logits"]
            torch.testing.assert_close(logits, theirs, rtol=0, atol=1e-5)
