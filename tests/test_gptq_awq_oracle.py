"""GPTQ and AWQ checkpoints packed by GPTQModel's and AutoAWQ's own code (tests/gptq_oracle.py):
every layer dequantizes bit-identical to the library's own CPU dequantization, v1 and v2 of the
same weights load identically, a mislabelled ``checkpoint_format`` is refused or differs, act-order
is refused with its reason, ``dynamic`` overrides pick per-module schemes, and the tiny Llama's
logits through ``apply_to_model`` equal a dense model holding the library's dequantized weights."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from checkpoint_cache import single_threaded_torch  # noqa: F401  (autouse)
from gptq_oracle import ENV, build_checkpoints, oracle_python
from oracle_jobs import references as producer_references
from safetensors.torch import load_file
from transformers import AutoConfig, LlamaForCausalLM

from qscheme.checkpoint import apply_to_model, load_checkpoint
from qscheme.checkpoint.resolve import resolve_checkpoint
from qscheme.errors import QSchemeError
from qscheme.modules import QuantLinear
from qscheme.writing.convert import convert_checkpoint

pytestmark = pytest.mark.oracle  # every test here reads what a side venv's process produced

MODEL = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
JOBS: dict[str, dict[str, object]] = {
    "v1_sym": {"kind": "gptq", "bits": 4, "group_size": 128, "sym": True, "checkpoint_format": "gptq", "seed": 1},
    "v2_sym": {"kind": "gptq", "bits": 4, "group_size": 128, "sym": True, "checkpoint_format": "gptq_v2", "seed": 1},
    "v1_asym": {"kind": "gptq", "bits": 4, "group_size": 32, "sym": False, "checkpoint_format": "gptq", "seed": 2},
    "v2_asym": {"kind": "gptq", "bits": 4, "group_size": 32, "sym": False, "checkpoint_format": "gptq_v2", "seed": 2},
    "w8": {"kind": "gptq", "bits": 8, "group_size": -1, "sym": True, "checkpoint_format": "gptq", "seed": 3},
    "w2": {"kind": "gptq", "bits": 2, "group_size": 128, "sym": False, "checkpoint_format": "gptq", "seed": 7},
    "w2_v2": {"kind": "gptq", "bits": 2, "group_size": 128, "sym": False, "checkpoint_format": "gptq_v2", "seed": 7},
    "w2_sym": {"kind": "gptq", "bits": 2, "group_size": 128, "sym": True, "checkpoint_format": "gptq", "seed": 10},
    "w2_sym_v2": {
        "kind": "gptq",
        "bits": 2,
        "group_size": 128,
        "sym": True,
        "checkpoint_format": "gptq_v2",
        "seed": 10,
    },
    "act_order": {
        "kind": "gptq",
        "bits": 4,
        "group_size": 32,
        "sym": True,
        "checkpoint_format": "gptq_v2",
        "act_order": True,
        "seed": 4,
    },
    "dynamic": {
        "kind": "gptq",
        "bits": 4,
        "group_size": 128,
        "sym": True,
        "checkpoint_format": "gptq",
        "dynamic": {r"-:.*mlp\.down_proj": {}, r"+:.*self_attn\.v_proj": {"bits": 8, "group_size": -1}},
        "seed": 5,
    },
    "awq": {"kind": "awq", "bits": 4, "group_size": 128, "seed": 6},
    # 3-bit: 32 codes in 3 int32 words, a bit stream whose codes straddle words
    "w3": {"kind": "gptq", "bits": 3, "group_size": 128, "sym": False, "checkpoint_format": "gptq", "seed": 8},
    "w3_v2": {"kind": "gptq", "bits": 3, "group_size": 128, "sym": False, "checkpoint_format": "gptq_v2", "seed": 8},
    "w3_sym_g32_act_order": {
        "kind": "gptq",
        "bits": 3,
        "group_size": 32,
        "sym": True,
        "checkpoint_format": "gptq",
        "act_order": True,
        "seed": 9,
    },
    "w3_channel_v2": {
        "kind": "gptq",
        "bits": 3,
        "group_size": -1,
        "sym": True,
        "checkpoint_format": "gptq_v2",
        "seed": 10,
    },
    # the other group sizes GPTQ users quantize with
    "w4_asym_g64_v2": {
        "kind": "gptq",
        "bits": 4,
        "group_size": 64,
        "sym": False,
        "checkpoint_format": "gptq_v2",
        "seed": 11,
    },
    "w4_asym_channel": {
        "kind": "gptq",
        "bits": 4,
        "group_size": -1,
        "sym": False,
        "checkpoint_format": "gptq",
        "seed": 12,
    },
    "w8_asym_g32": {"kind": "gptq", "bits": 8, "group_size": 32, "sym": False, "checkpoint_format": "gptq", "seed": 13},
    "w8_g64_v2": {"kind": "gptq", "bits": 8, "group_size": 64, "sym": True, "checkpoint_format": "gptq_v2", "seed": 14},
}
SCHEMES = {
    "v1_sym": {"gptq/W4A16"},
    "v2_sym": {"gptq_v2/W4A16"},
    "v1_asym": {"gptq/W4A16_ASYM_G32"},
    "v2_asym": {"gptq_v2/W4A16_ASYM_G32"},
    "w8": {"gptq/W8A16_CHANNEL"},
    "w2": {"gptq/W2A16_ASYM"},
    "w2_v2": {"gptq_v2/W2A16_ASYM"},
    "w2_sym": {"gptq/W2A16"},
    "w2_sym_v2": {"gptq_v2/W2A16"},
    "dynamic": {"gptq/W4A16", "gptq/W8A16_CHANNEL"},
    "act_order": {"gptq_v2/W4A16_G32"},
    "awq": {"awq/W4A16_ASYM"},
    "w3": {"gptq/W3A16_ASYM"},
    "w3_v2": {"gptq_v2/W3A16_ASYM"},
    "w3_sym_g32_act_order": {"gptq/W3A16_G32"},
    "w3_channel_v2": {"gptq_v2/W3A16_CHANNEL"},
    "w4_asym_g64_v2": {"gptq_v2/W4A16_ASYM_G64"},
    "w4_asym_channel": {"gptq/W4A16_ASYM_CHANNEL"},
    "w8_asym_g32": {"gptq/W8A16_ASYM_G32"},
    "w8_g64_v2": {"gptq_v2/W8A16_G64"},
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gptq_awq")
    jobs = [{**job, "dst": str(root / name), "model": MODEL} for name, job in JOBS.items()]
    build_checkpoints(jobs, python=oracle_python())
    return {name: root / name for name in JOBS}


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_every_layer_dequantizes_bit_identical_to_the_library(folders: dict[str, Path], name: str) -> None:
    checkpoint = load_checkpoint(folders[name])
    references = producer_references(folders[name])
    assert set(checkpoint.modules) == set(references)
    assert {layer.scheme.name for layer in checkpoint.modules.values()} == SCHEMES[name]
    for module, layer in checkpoint.modules.items():
        ours = layer.dequantize()
        assert ours.dtype == torch.float32
        assert torch.equal(ours, references[module]), module


def test_v1_and_v2_of_the_same_weights_load_to_identical_weights(folders: dict[str, Path]) -> None:
    for v1, v2 in (
        ("v1_sym", "v2_sym"),
        ("v1_asym", "v2_asym"),
        ("w2", "w2_v2"),
        ("w2_sym", "w2_sym_v2"),
        ("w3", "w3_v2"),
    ):
        first, second = load_checkpoint(folders[v1]), load_checkpoint(folders[v2])
        stored_v1 = load_file(folders[v1] / "model.safetensors")
        stored_v2 = load_file(folders[v2] / "model.safetensors")
        zeros = "model.layers.0.self_attn.q_proj.qzeros"
        assert not torch.equal(stored_v1[zeros], stored_v2[zeros])  # the files differ: zero - 1 vs zero
        for module, layer in first.modules.items():
            assert torch.equal(layer.dequantize(), second.modules[module].dequantize()), (v1, module)


def _relabelled(folders: dict[str, Path], name: str, tmp_path: Path, checkpoint_format: str) -> Path:
    folder = tmp_path / f"{name}_as_{checkpoint_format}"
    shutil.copytree(folders[name], folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["checkpoint_format"] = checkpoint_format
    config["quantization_config"]["format"] = checkpoint_format
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_mislabelled_checkpoint_format_is_refused_or_differs(folders: dict[str, Path], tmp_path: Path) -> None:
    # symmetric: the stored zero points contradict the label, so the load is refused, naming them
    for name, label in (("v2_sym", "gptq"), ("v1_sym", "gptq_v2")):
        with pytest.raises(QSchemeError, match=r"zero points 'qzeros' must all be 0 .*config says sym"):
            load_checkpoint(_relabelled(folders, name, tmp_path, label))
    # asymmetric: any zero point is possible, so the label decides; read as v1, every weight of the
    # v2 file moves by one scale step: the two readings differ everywhere
    wrong = load_checkpoint(_relabelled(folders, "v2_asym", tmp_path, "gptq"))
    right = load_checkpoint(folders["v2_asym"])
    for module, layer in wrong.modules.items():
        assert not torch.equal(layer.dequantize(), right.modules[module].dequantize()), module


def test_act_order_loads_exactly_on_cpu_gemv_and_the_trace_says_why_tinygemm_declines(folders: dict[str, Path]) -> None:
    """GPTQModel's act-order layers run on cpu_gemv, which permutes its input into the codes' order
    (within its declared bound of the reference kernel); tinygemm_cpu takes input channels in order."""
    from test_cpu_gemv import check_close

    g_idx = load_file(folders["act_order"] / "model.safetensors")["model.layers.0.self_attn.q_proj.g_idx"]
    assert not torch.equal(g_idx, torch.arange(g_idx.numel(), dtype=g_idx.dtype) // 32)  # a real act-order file
    checkpoint = load_checkpoint(folders["act_order"])
    generator = torch.Generator().manual_seed(5)
    for layer in checkpoint.modules.values():  # (bit-identical weights: test_every_layer_dequantizes_...)
        assert layer.kernel.name == "cpu_gemv"
        tinygemm = layer.resolution.candidate("tinygemm_cpu")
        assert not tinygemm.accepted and "permuted (GPTQ act-order" in tinygemm.reason
        weight = layer.weight_canonical
        assert weight.input_permutation is not None
        x = torch.randn(3, weight.k, generator=generator).to(torch.bfloat16)
        reference = QuantLinear.from_canonical(weight, kernel="reference")
        check_close(weight, x, layer(x), reference(x))
    # `qscheme resolve` reads the group index too (a [K] tensor), and says the same before loading
    _, decisions = resolve_checkpoint(folders["act_order"], device="cpu")
    assert {decision.resolution.kernel.name for decision in decisions} == {"cpu_gemv"}  # type: ignore[union-attr]


def test_dynamic_overrides_pick_each_modules_scheme_or_leave_it_unquantized(folders: dict[str, Path]) -> None:
    checkpoint = load_checkpoint(folders["dynamic"])
    assert "model.layers.0.mlp.down_proj" not in checkpoint.modules
    assert checkpoint.modules["model.layers.0.self_attn.v_proj"].scheme.name == "gptq/W8A16_CHANNEL"
    assert checkpoint.modules["model.layers.0.self_attn.q_proj"].scheme.name == "gptq/W4A16"
    assert "model.layers.0.mlp.down_proj.weight" in checkpoint.tensors


def _dense_and_quantized(folder: Path) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    config = AutoConfig.from_pretrained(str(folder))
    del config.quantization_config
    torch.manual_seed(0)
    quantized = LlamaForCausalLM(config).eval()
    dense = LlamaForCausalLM(config).eval()
    state = load_file(folder / "model.safetensors")
    plain = {name: value for name, value in state.items() if name in dense.state_dict()}
    plain.update({f"{module}.weight": weight for module, weight in producer_references(folder).items()})
    missing, unexpected = dense.load_state_dict(plain, strict=False)
    assert not unexpected and all(name.endswith("rotary_emb.inv_freq") for name in missing), missing
    apply_to_model(quantized, folder, kernel="reference")
    return dense, quantized


@pytest.mark.parametrize("name", ["v1_asym", "dynamic", "awq", "act_order", "w2", "w3", "w3_sym_g32_act_order"])
def test_tiny_llama_logits_equal_the_dense_model_of_the_librarys_weights(folders: dict[str, Path], name: str) -> None:
    dense, quantized = _dense_and_quantized(folders[name])
    assert isinstance(quantized.model.layers[0].self_attn.q_proj, QuantLinear)
    tokens = torch.tensor([[1, 5, 9, 17, 33, 65, 127]])
    with torch.no_grad():
        expected, got = dense(tokens).logits, quantized(tokens).logits
    error = float((got - expected).abs().max())
    assert error <= 1e-5 * float(expected.abs().max()), error


def test_3bit_layers_run_on_the_reference_kernel_and_triton_and_the_trace_says_why_others_decline(
    folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from qscheme.cli.main import main

    assert main(["inspect", str(folders["w3"])]) == 0
    assert "gptq/W3A16_ASYM" in capsys.readouterr().out
    checkpoint = load_checkpoint(folders["w3"], kernel="reference")
    with monkeypatch.context() as patch:  # a plain CPU: no Triton interpreter
        patch.delenv("TRITON_INTERPRET", raising=False)
        _, on_cpu = resolve_checkpoint(folders["w3"], device="cpu")
    assert {decision.resolution.kernel.name for decision in on_cpu} == {"reference"}  # type: ignore[union-attr]
    for layer in checkpoint.modules.values():
        for name in ("tinygemm_cpu", "marlin"):
            declined = layer.resolution.candidate(name)
            assert not declined.accepted and "scheme has int3 weights" in declined.reason, name
    # on a GPU, Triton takes 3-bit weights (decoded one code per byte, as int8); the declaration says so
    _, decisions = resolve_checkpoint(folders["w3"], device="sm90")
    assert {decision.resolution.kernel.name for decision in decisions} == {"triton"}  # type: ignore[union-attr]
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel runs on the CPU only under TRITON_INTERPRET=1")
    triton = load_checkpoint(folders["w3"], kernel="triton")
    inputs = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    for module, layer in triton.modules.items():
        if layer.in_features != 128:
            continue
        reference = checkpoint.modules[module]
        with torch.no_grad():
            expected, got = reference(inputs), layer(inputs)
        assert layer.kernel.name == "triton"
        assert float((got - expected).abs().max()) <= 1e-4 * float(expected.abs().max()), module


def test_int4_layers_run_on_cpu_gemv_within_its_bound(folders: dict[str, Path]) -> None:
    """GPTQModel's and AutoAWQ's int4 layers (zero points included) run on cpu_gemv, which ranks above
    tinygemm_cpu for int4 in groups of 64 or more (both accepted; groups of 32 stay on tinygemm_cpu),
    within its bound at M = 1 to 4 (its VNNI loop where the CPU has one) and 7, groups of 32 too."""
    from test_cpu_gemv import check_close

    generator = torch.Generator().manual_seed(6)
    for name, chosen in (("v1_sym", "cpu_gemv"), ("v1_asym", "tinygemm_cpu"), ("awq", "cpu_gemv")):
        checkpoint = load_checkpoint(folders[name])
        assert {layer.kernel.name for layer in checkpoint.modules.values()} == {chosen}, name
        for layer in checkpoint.modules.values():
            assert layer.resolution.candidate("tinygemm_cpu").accepted, name
            assert layer.resolution.candidate("cpu_gemv").accepted, name
            weight = layer.weight_canonical
            gemv = QuantLinear.from_canonical(weight, kernel="cpu_gemv")
            reference = QuantLinear.from_canonical(weight, kernel="reference")
            for rows in (1, 4, 7):
                x = torch.randn(rows, weight.k, generator=generator).to(torch.bfloat16)
                check_close(weight, x, gemv(x), reference(x))


def test_the_oracle_is_exported_in_ci() -> None:
    """In CI the oracle must be there (scripts/test.sh builds and exports it): fail, never skip."""
    if not os.environ.get("CI"):
        pytest.skip("outside CI the oracle may be absent")
    assert os.environ.get(ENV), f"{ENV} is not set in CI; scripts/test.sh exports it"


def _compressed_tensors_dequantize(folder: Path, module: str) -> torch.Tensor:
    """compressed-tensors' own decompression of one converted module, its scales in float32."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    group = dict(next(iter(config["config_groups"].values())))
    fmt = group.pop("format", None) or config["format"]
    state = {
        name.removeprefix(f"{module}."): value.float() if value.dtype == torch.float16 else value
        for name, value in load_file(folder / "model.safetensors").items()
        if name.startswith(f"{module}.")
    }
    scheme = QuantizationScheme.model_validate(group)
    return BaseCompressor.get_value_from_registry(fmt).decompress(state, scheme)["weight"].to(torch.float32)


@pytest.mark.parametrize(
    ("name", "target"),
    [("v1_sym", "compressed-tensors/W4A16"), ("awq", "compressed-tensors/W4A16_ASYM")],
)
def test_convert_to_compressed_tensors_keeps_the_librarys_weights(
    folders: dict[str, Path], tmp_path: Path, name: str, target: str
) -> None:
    summary = convert_checkpoint(folders[name], tmp_path / "ct", target)
    converted = [row for row in summary.layers if row.action == "converted"]
    assert len(converted) == 7 and {row.max_ulps for row in converted} == {0}
    references = producer_references(folders[name])
    for module, weight in references.items():
        # compressed-tensors' own decompression of the converted layer is GPTQModel's / AutoAWQ's weight
        assert torch.equal(_compressed_tensors_dequantize(tmp_path / "ct", module), weight), module


def test_convert_refuses_act_order_with_its_reason(folders: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(QSchemeError, match=r"assigns groups out of order \(GPTQ act-order\).*no permutation"):
        convert_checkpoint(folders["act_order"], tmp_path / "ct", "compressed-tensors/W4A16_G32")


@pytest.mark.parametrize("name", ["v1_asym", "awq", "w3"])
def test_from_pretrained_through_the_qscheme_route_equals_the_dense_model(folders: dict[str, Path], name: str) -> None:
    from transformers import AutoModelForCausalLM

    from qscheme.transformers import via_qscheme

    dense, _ = _dense_and_quantized(folders[name])
    config = via_qscheme(folders[name])
    assert config.quantization_config["quant_method"] == f"qscheme-{JOBS[name]['kind']}"
    model = AutoModelForCausalLM.from_pretrained(folders[name], config=config, dtype=torch.float32).eval()
    assert isinstance(model.model.layers[0].mlp.down_proj, QuantLinear)
    tokens = torch.tensor([[1, 5, 9, 17, 33, 65, 127]])
    with torch.no_grad():
        expected, got = dense(tokens).logits, model(tokens).logits
    error = float((got - expected).abs().max())
    assert error <= 1e-5 * float(expected.abs().max()), error
