"""`qscheme resolve CHECKPOINT --engine vllm` and `--m` on a checkpoint, and apply_to_model(m_split=).

A tiny Llama (hidden 64, intermediate 128, 4 heads, 2 KV heads, 2 layers) is quantized here by
``qscheme quantize`` (compressed-tensors NVFP4A16 and W4A16); the NVFP4 one has k_proj, v_proj and
up_proj given global scales of their own, so that a fused layer holds different ones. Expected
values come from the model's own sizes, vLLM's Llama fusing (q/k/v -> qkv_proj, gate/up ->
gate_up_proj) and the scheme-level resolver (`qscheme resolve SCHEME --shape N,K`), a separate
path through the CLI.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from kernel_fakes import isolated_plugins

from qscheme.cli.main import main
from qscheme.engines.vllm_layers import LLAMA_PACKED_MODULES, fused_members, packed_modules_for, vllm_layers
from qscheme.errors import UsageError
from qscheme.kernels.problem import Problem

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 4, 2, 16
QKV_N = (HEADS + 2 * KV_HEADS) * HEAD_DIM
FACTORS = {"self_attn.k_proj": 2.0, "self_attn.v_proj": 0.5, "mlp.up_proj": 4.0}


@pytest.fixture(autouse=True)
def builtins_only(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    for name in ("QSCHEME_KERNEL", "QSCHEME_DISABLED_KERNELS", "QSCHEME_M_SPLIT"):
        monkeypatch.delenv(name, raising=False)
    with isolated_plugins():
        yield


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from qscheme.writing.quantize import quantize_checkpoint

    root = tmp_path_factory.mktemp("engine")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(root / "dense")
    out = {"dense": root / "dense"}
    for name, scheme in (("nvfp4", "compressed-tensors/NVFP4A16"), ("w4a16", "compressed-tensors/W4A16")):
        quantize_checkpoint(root / "dense", root / name, scheme)
        out[name] = root / name
    files = sorted(out["nvfp4"].glob("*.safetensors"))
    state = load_file(files[0])
    for module, factor in FACTORS.items():
        for i in range(2):
            key = f"model.layers.{i}.{module}.weight_global_scale"
            state[key] = state[key] * factor
    save_file(state, files[0], metadata={"format": "pt"})
    return out


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def scheme_kernel(scheme: str, n: int, k: int, device: str, capsys: pytest.CaptureFixture[str], *extra: str) -> dict:
    code, out, _ = run(["resolve", scheme, "--shape", f"{n},{k}", "--device", device, "--json", *extra], capsys)
    assert code == 0
    return json.loads(out)  # type: ignore[no-any-return]


def test_layers_group_as_vllm_fuses_them() -> None:
    modules = [f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"] + [
        f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")
    ]
    layers = {layer.name: layer.members for layer in vllm_layers(modules, LLAMA_PACKED_MODULES)}
    assert layers == {
        "model.layers.0.self_attn.qkv_proj": tuple(f"model.layers.0.self_attn.{p}_proj" for p in "qkv"),
        "model.layers.0.self_attn.o_proj": ("model.layers.0.self_attn.o_proj",),
        "model.layers.0.mlp.gate_up_proj": ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"),
        "model.layers.0.mlp.down_proj": ("model.layers.0.mlp.down_proj",),
    }
    # the plugin's own lookup (QschemeConfig._members) gives the same members back
    for name, members in layers.items():
        assert tuple(fused_members(name, LLAMA_PACKED_MODULES)) == members
    experts = [f"model.layers.1.mlp.experts.{e}.{p}" for e in (1, 0) for p in ("gate_proj", "up_proj", "down_proj")]
    (moe,) = vllm_layers(experts, packed_modules_for(["Qwen3MoeForCausalLM"]))
    assert (moe.name, moe.kind) == ("model.layers.1.mlp.experts", "fused_moe")
    assert moe.members == tuple(experts[3:] + experts[:3])  # expert 0 first
    assert packed_modules_for(["SomethingNew"]) is LLAMA_PACKED_MODULES


def test_engine_vllm_json_tp2(folders: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        ["resolve", str(folders["nvfp4"]), "--engine", "vllm", "--tp", "2", "--device", "cpu", "--json"], capsys
    )
    assert code == 0
    data = json.loads(out)
    layers = {item["layer"]: item for item in data["layers"]}
    assert len(layers) == 8  # qkv_proj, o_proj, gate_up_proj, down_proj in each of 2 layers
    qkv = layers["model.layers.0.self_attn.qkv_proj"]
    (part,) = qkv["parts"]
    assert [s["member"].rpartition(".")[2] for s in part["shards"]] == ["q_proj", "k_proj", "v_proj"]
    assert [(s["shard_n"], s["shard_k"]) for s in part["shards"]] == [(HEADS * HEAD_DIM // 2, HIDDEN)] + [
        (KV_HEADS * HEAD_DIM // 2, HIDDEN)
    ] * 2
    assert part["style"] == "column" and part["problem"]["n"] == QKV_N // 2
    scales = [part["global_scales"][f"model.layers.0.self_attn.{p}_proj"][0] for p in "qkv"]
    assert scales[1] == pytest.approx(2 * scales[0]) and scales[2] == pytest.approx(0.5 * scales[0])
    assert part["problem"]["partition_scales_differ"] is True
    expected = scheme_kernel(
        "compressed-tensors/NVFP4A16", QKV_N // 2, HIDDEN, "cpu", capsys, "--partitions", "3", "--scales-differ"
    )
    assert part["kernel"] == expected["kernel"] is not None
    down = layers["model.layers.1.mlp.down_proj"]["parts"][0]
    assert down["style"] == "row" and (down["problem"]["n"], down["problem"]["k"]) == (HIDDEN, INTERMEDIATE // 2)
    builtin = qkv["vllm_builtin"]
    assert builtin["scheme_class"].startswith("CompressedTensorsW4A4Fp4") and builtin["cpu"] is None


def test_engine_vllm_text_refuses_what_cannot_split(
    folders: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(["resolve", str(folders["w4a16"]), "--engine", "vllm", "--tp", "4", "--device", "cpu"], capsys)
    assert code == 1
    assert "vLLM fuses: qkv_proj <- q_proj/k_proj/v_proj, gate_up_proj <- gate_proj/up_proj" in out
    # K = 128 of down_proj cut 4 ways leaves 32 columns per rank: less than one W4A16 scale group of 128
    assert "layer model.layers.0.mlp.down_proj (compressed-tensors/W4A16, row-parallel)" in out
    assert "cuts a scale group of 128" in out
    assert "exceeds the 2 KV heads" in out
    assert "CompressedTensorsWNA16; on CPU CPUWNA16LinearKernel" in out


def test_engine_vllm_shows_plans_and_different_scales(
    folders: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(
        ["resolve", str(folders["nvfp4"]), "--engine", "vllm", "--device", "cpu", "--m", "1,16,256"], capsys
    )
    assert code == 0
    assert "3 kept, different" in out and "2 kept, different" in out
    plan = scheme_kernel(
        "compressed-tensors/NVFP4A16",
        QKV_N,
        HIDDEN,
        "cpu",
        capsys,
        "--partitions",
        "3",
        "--scales-differ",
        "--m",
        "1,16,256",
    )
    shown = "  ".join(f"M={b['m']}: {b['kernel']}" for b in plan["batch_sizes"])
    assert "model.layers.*.self_attn.qkv_proj: " in out and shown in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--engine", "sglang"], "--engine 'sglang': not an engine qscheme explains; allowed: vllm"),
        (["--engine", "vllm", "--tp", "0"], "--tp '0' with --engine vllm: expected vLLM's tensor_parallel_size"),
        (["--engine", "vllm", "--tp", "auto"], "--tp 'auto' with --engine vllm"),
        (["--engine", "vllm", "--m", "1,x"], "--m '1,x': expected batch sizes"),
        (["--tp", "2", "--m", "1"], "--m and --m-split: not with --tp"),
    ],
)
def test_engine_usage_errors(
    folders: dict[str, Path], extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(["resolve", str(folders["w4a16"]), *extra], capsys)
    assert code == 2 and message in err


def test_engine_needs_a_checkpoint_folder(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["resolve", "compressed-tensors/W4A16", "--engine", "vllm"], capsys)
    assert code == 2 and "--engine vllm: for a checkpoint folder" in err


def test_checkpoint_plans_over_m(folders: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    from qscheme.kernels import registry

    code, out, _ = run(["resolve", str(folders["nvfp4"]), "--device", "cpu", "--m", "1,16,256", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    plans = {item["layer"]: item for item in data["plans"]}
    o_proj = plans["model.layers.0.self_attn.o_proj"]
    expected = scheme_kernel("compressed-tensors/NVFP4A16", HIDDEN, HIDDEN, "cpu", capsys, "--m", "1,16,256")
    assert o_proj["plan"] == expected["plan"] and o_proj["batch_sizes"] == expected["batch_sizes"]
    # each boundary's source: the declared range that applies to these layers (bf16 inputs, e2m1 weights)
    problem = Problem(HIDDEN, HIDDEN, "bfloat16", weight_format="e2m1")
    for boundary in data["boundaries"]:
        entry = registry.get_declaration(boundary["kernel"]).batch_entry("cpu", problem)
        assert boundary["source"] == (entry.source if entry is not None else None)
    # an override moves every boundary, and the text says where each comes from
    code, text, _ = run(["resolve", str(folders["nvfp4"]), "--device", "cpu", "--m", "1,40", "--m-split", "32"], capsys)
    assert code == 0 and "override: 32" in text and "boundaries:" in text
    if len({entry["kernel"] for entry in o_proj["plan"]}) > 1:
        assert "M <= 31" in text and "M >= 32" in text


def test_apply_to_model_passes_m_split_to_every_layer(folders: dict[str, Path]) -> None:
    from transformers import LlamaForCausalLM

    import qscheme
    from qscheme.modules import QuantLinear

    model = LlamaForCausalLM.from_pretrained(folders["dense"], torch_dtype=torch.bfloat16)
    with pytest.raises(UsageError, match=r"apply_to_model\(m_split=\.\.\.\)='sometimes'"):
        qscheme.apply_to_model(model, folders["nvfp4"], m_split="sometimes")
    assert not any(isinstance(m, QuantLinear) for m in model.modules())  # refused before any change
    qscheme.apply_to_model(model, folders["nvfp4"], m_split="off")
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 14
    for layer in layers:
        assert layer.m_split == "off"
        assert layer.kernel_for_batch(4096).name == layer.kernel_for_batch(1).name


def test_engine_vllm_moe_experts_are_one_fused_moe_layer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A tiny Qwen3-MoE (8 experts, hidden and expert width 128) in compressed-tensors NVFP4A16, as
    tests/test_experts.py writes it with the library, its config naming the architecture."""
    import shutil

    from test_experts import EXPERTS, HIDDEN, INNER, cached_moe_checkpoint

    folder = shutil.copytree(cached_moe_checkpoint("NVFP4A16"), tmp_path / "moe")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["Qwen3MoeForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    code, out, _ = run(["resolve", str(folder), "--engine", "vllm", "--tp", "2", "--device", "cpu", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["packed_modules_mapping"] == {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}  # vLLM's Qwen3-MoE
    experts = next(item for item in data["layers"] if item["layer"] == "model.layers.0.mlp.experts")
    assert experts["kind"] == "fused_moe" and len(experts["members"]) == 3 * EXPERTS
    parts = {part["name"].rpartition(".")[2]: part for part in experts["parts"]}
    # as the plugin's MoE method builds each expert: gate and up as one layer (vLLM's w13), down (w2)
    assert set(parts) == {"gate_up_proj", "down_proj"}
    gate_up, down = parts["gate_up_proj"], parts["down_proj"]
    assert gate_up["members"] == ["model.layers.0.mlp.experts.0.gate_proj", "model.layers.0.mlp.experts.0.up_proj"]
    # vLLM's fused MoE splits each expert's intermediate size: gate/up by rows, down by K
    assert (gate_up["style"], gate_up["problem"]["n"], gate_up["problem"]["k"]) == ("column", INNER, HIDDEN)
    assert gate_up["problem"]["partitions"] == 2
    assert (down["style"], down["problem"]["n"], down["problem"]["k"]) == ("row", HIDDEN, INNER // 2)
    assert len(gate_up["global_scales"]) == 2 * EXPERTS and len(down["global_scales"]) == EXPERTS  # each kept
    code, text, _ = run(["resolve", str(folder), "--engine", "vllm", "--device", "cpu"], capsys)
    assert (
        code == 0
        and f"{EXPERTS} kept, one per expert," in text
        and f"{2 * EXPERTS} kept, one per expert and partition" in text
        and "vLLM fuses: qkv_proj <- q_proj/k_proj/v_proj\n" in text
    )
