"""AutoRound checkpoints (``quant_method: auto-round``) quantized and exported by AutoRound's own code
(tests/auto_round_oracle.py): every layer dequantizes bit-identical to AutoRound's own layer, each
``packing_format`` takes the GPTQ or AWQ scheme of its layout, ``extra_config`` picks per-layer
schemes, the tiny Llama's logits through ``apply_to_model`` and ``from_pretrained`` equal a dense
model holding AutoRound's weights, and what qscheme does not read is a typed error naming the key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from auto_round_oracle import build_checkpoints, oracle_python
from checkpoint_cache import single_threaded_torch  # noqa: F401  (autouse)
from oracle_jobs import references as producer_references
from safetensors.torch import load_file
from transformers import AutoConfig, LlamaForCausalLM

from qscheme.checkpoint import apply_to_model, load_checkpoint
from qscheme.checkpoint.resolve import resolve_checkpoint
from qscheme.cli.main import main
from qscheme.errors import CheckpointError, QSchemeError
from qscheme.modules import QuantLinear
from qscheme.producers.auto_round.config import read_section
from qscheme.producers.base import ConfigFields

pytestmark = pytest.mark.oracle  # every test here: its module's fixture runs the producers in side venvs

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
DOWN = "model.layers.0.mlp.down_proj"
JOBS: dict[str, dict[str, Any]] = {
    # asymmetric: AutoRound packs with its own "auto_round" layout (GPTQ's, zero points as they are);
    # one layer in 8-bit symmetric through extra_config
    "asym": {"bits": 4, "group_size": 32, "sym": False, "layer_config": {DOWN: {"bits": 8, "sym": True}}, "seed": 1},
    # symmetric: AutoRound switches to "auto_round:auto_gptq" (GPTQ v1: zero points minus one)
    "sym_3bit": {"bits": 3, "group_size": 32, "sym": True, "seed": 2},
    # 4-bit symmetric: GPTQ v1 words that tinygemm runs, with AutoRound's signed scales
    "sym_4bit": {"bits": 4, "group_size": 128, "sym": True, "seed": 4},
    # AutoAWQ's GEMM layout
    "awq": {"bits": 4, "group_size": 128, "sym": False, "format": "auto_round:auto_awq", "seed": 3},
}
PACKING = {
    "asym": "auto_round",
    "sym_3bit": "auto_round:auto_gptq",
    "sym_4bit": "auto_round:auto_gptq",
    "awq": "auto_round:auto_awq",
}
SCHEMES = {
    "asym": {"gptq_v2/W4A16_ASYM_G32", "gptq_v2/W8A16_G32"},
    "sym_3bit": {"gptq/W3A16_G32"},
    "sym_4bit": {"gptq/W4A16"},
    "awq": {"awq/W4A16_ASYM"},
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("auto_round")
    jobs = [{**job, "dst": str(root / name), "model": MODEL} for name, job in JOBS.items()]
    build_checkpoints(jobs, python=oracle_python())
    return {name: root / name for name in JOBS}


def _section(folder: Path) -> dict[str, Any]:
    section = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert isinstance(section, dict)
    return section


@pytest.mark.parametrize("name", sorted(JOBS))
def test_every_layer_dequantizes_bit_identical_to_autorounds_own_layer(folders: dict[str, Path], name: str) -> None:
    section = _section(folders[name])
    assert section["quant_method"] == "auto-round" and section["packing_format"] == PACKING[name]
    checkpoint = load_checkpoint(folders[name])
    references = producer_references(folders[name])
    assert set(checkpoint.modules) == set(references) and len(references) == 7
    assert {layer.scheme.name for layer in checkpoint.modules.values()} == SCHEMES[name]
    assert checkpoint.producer == "auto-round"
    for module, layer in checkpoint.modules.items():
        assert torch.equal(layer.dequantize(), references[module]), module


def test_extra_config_gives_a_layer_its_own_scheme(folders: dict[str, Path]) -> None:
    section = _section(folders["asym"])
    assert section["extra_config"] == {DOWN: {"bits": 8, "sym": True}}  # what AutoRound wrote
    checkpoint = load_checkpoint(folders["asym"])
    assert checkpoint.modules[DOWN].scheme.name == "gptq_v2/W8A16_G32"
    assert checkpoint.modules["model.layers.0.mlp.up_proj"].scheme.name == "gptq_v2/W4A16_ASYM_G32"


def _dense_and_quantized(folder: Path) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    config = AutoConfig.from_pretrained(str(folder))
    del config.quantization_config
    torch.manual_seed(0)
    quantized = LlamaForCausalLM(config).eval()
    dense = LlamaForCausalLM(config).eval()
    state = load_file(folder / "model.safetensors")
    plain = {name: value.float() for name, value in state.items() if name in dense.state_dict()}
    plain.update({f"{module}.weight": weight for module, weight in producer_references(folder).items()})
    missing, unexpected = dense.load_state_dict(plain, strict=False)
    assert not unexpected and all(name.endswith("rotary_emb.inv_freq") for name in missing), missing
    apply_to_model(quantized, folder, kernel="reference")
    return dense, quantized


def _close(expected: torch.Tensor, got: torch.Tensor) -> None:
    error = float((got - expected).abs().max())
    assert error <= 1e-5 * float(expected.abs().max()), error


TOKENS = torch.tensor([[1, 5, 9, 17, 33, 65, 127]])


@pytest.mark.parametrize("name", ["asym", "awq"])
def test_tiny_llama_logits_equal_the_dense_model_of_autorounds_weights(folders: dict[str, Path], name: str) -> None:
    dense, quantized = _dense_and_quantized(folders[name])
    assert isinstance(quantized.model.layers[0].mlp.down_proj, QuantLinear)
    with torch.no_grad():
        _close(dense(TOKENS).logits, quantized(TOKENS).logits)


def test_from_pretrained_through_the_qscheme_route_equals_the_dense_model(folders: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    from qscheme.transformers import via_qscheme

    dense, _ = _dense_and_quantized(folders["sym_3bit"])
    config = via_qscheme(folders["sym_3bit"])
    assert config.quantization_config["quant_method"] == "qscheme-auto-round"
    model = AutoModelForCausalLM.from_pretrained(folders["sym_3bit"], config=config, dtype=torch.float32).eval()
    assert isinstance(model.model.layers[0].self_attn.q_proj, QuantLinear)
    with torch.no_grad():
        _close(dense(TOKENS).logits, model(TOKENS).logits)


def test_inspect_and_resolve_name_the_producer_and_the_schemes(
    folders: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(folders["asym"])]) == 0
    out = capsys.readouterr().out
    assert "producer: auto-round" in out and "gptq_v2/W8A16_G32" in out and "gptq_v2/W4A16_ASYM_G32" in out
    _, decisions = resolve_checkpoint(folders["sym_3bit"], device="sm90")
    assert {decision.resolution.kernel.name for decision in decisions} == {"triton"}  # type: ignore[union-attr]


def test_signed_scales_load_and_run_on_tinygemm_within_its_declared_bound(folders: dict[str, Path]) -> None:
    from qscheme_plugins.tinygemm_kernel import TinygemmCpuKernel
    from test_tinygemm import CPU, assert_within, expected_and_bound

    from qscheme.canonical import canonicalize
    from qscheme.catalog import load_scheme

    state = load_file(folders["sym_4bit"] / "model.safetensors")
    module = "model.layers.0.mlp.gate_proj"
    tensors = {name.rpartition(".")[2]: value for name, value in state.items() if name.startswith(f"{module}.")}
    assert bool((tensors["scales"] < 0).any())  # AutoRound's symmetric scales carry a sign
    weight = canonicalize(load_scheme("gptq/W4A16"), tensors)
    kernel = TinygemmCpuKernel()
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    expected, bound = expected_and_bound(weight, x, None, CPU)
    assert_within(kernel.apply(kernel.prepare(weight, CPU), x, None), expected, bound, module)
    assert {layer.kernel.name for layer in load_checkpoint(folders["sym_4bit"]).modules.values()} == {"cpu_gemv"}


def _relabelled(folders: dict[str, Path], name: str, tmp_path: Path, **changes: Any) -> Path:
    folder = tmp_path / name
    shutil.copytree(folders[name], folder)
    document = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            document["quantization_config"].pop(key, None)
        else:
            document["quantization_config"][key] = value
    (folder / "config.json").write_text(json.dumps(document))
    return folder


@pytest.mark.parametrize(
    ("name", "changes", "message"),
    [
        (
            "asym",
            {"packing_format": "auto_round:llm_compressor"},
            r"packing_format: 'auto_round:llm_compressor' is not",
        ),
        ("asym", {"data_type": "mx_fp"}, r"data_type: 'mx_fp' weights are not stored in the integer layouts"),
        ("asym", {"act_bits": 8}, r"act_bits: 8 quantizes activations too"),
        ("asym", {"extra_config": {DOWN: {"bits": 16}}}, rf"module {DOWN} stores quantized tensors .*floating point"),
        ("asym", {"block_name_to_quantize": "model.layers.1"}, r"outside block_name_to_quantize \['model.layers.1'\]"),
        ("awq", {"bits": 8}, r"version 'gemm' with bits 8, group_size 128, zero_point True matches no scheme"),
        ("sym_3bit", {"bits": 4}, r"qweight"),  # 3-bit words read as 4-bit: the shapes disagree, named
        ("asym", {"packing_format": "auto_round:auto_gptq"}, r"qzeros"),  # zero points as they are, read as v1
    ],
)
def test_what_qscheme_does_not_read_is_a_typed_error_naming_it(
    folders: dict[str, Path], tmp_path: Path, name: str, changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(QSchemeError, match=message):
        load_checkpoint(_relabelled(folders, name, tmp_path, **changes))


# ------------------------------------------------------------------- the config, as AutoRound reads it


def _config(**items: Any) -> Any:
    return read_section(ConfigFields("config.json", "quantization_config", {"quant_method": "auto-round", **items}))


def test_extra_config_keys_are_a_layer_name_first_then_the_first_pattern_found_in_it() -> None:
    config = _config(
        bits=4,
        group_size=128,
        sym=True,
        extra_config={
            "mlp": {"bits": 8},  # a pattern, found in every mlp layer
            r"layers\.0\.mlp\.up_proj": {"bits": 2},  # later: loses to the first that matches
            "model.layers.0.mlp.down_proj": {"bits": 3},  # a layer's own name wins over patterns
            "model.layers.0.self_attn.o_proj": {"bits": 16},  # left in floating point
        },
    )
    layers = frozenset(
        {"model.layers.0.mlp.down_proj", "model.layers.0.mlp.up_proj", "model.layers.0.self_attn.o_proj"}
    )
    assert config.module_values("model.layers.0.mlp.down_proj", layers)[0]["bits"] == 3
    assert config.module_values("model.layers.0.mlp.up_proj", layers)[0]["bits"] == 8
    assert config.module_values("model.layers.0.self_attn.q_proj", layers)[0]["bits"] == 4
    values, origin = config.module_values("model.layers.0.self_attn.o_proj", layers)
    assert values is None and "extra_config" in origin


def test_block_names_may_be_a_string_a_list_or_lists_named_by_their_common_prefix() -> None:
    assert _config(bits=4, group_size=128, block_name_to_quantize="model.layers, vision.blocks").blocks == (
        "model.layers",
        "vision.blocks",
    )
    lists = [["model.layers.0", "model.layers.1", "model.layers.10"]]
    assert _config(bits=4, group_size=128, block_name_to_quantize=lists).blocks == ("model.layers",)
    config = _config(
        bits=4, group_size=128, to_quant_block_names=["model.layers"], extra_config={"lm_head": {"bits": 4}}
    )
    assert config.module_values("lm_head")[0] is not None  # outside the blocks, named in extra_config
    assert config.module_values("model.embed")[0] is None


def test_packing_formats_map_to_the_layouts_autoround_packs_with() -> None:
    formats = ("auto_round:auto_gptq", "auto_round:gptq", "auto", "auto_round", "auto_round:gptqmodel")
    layouts = {}
    for fmt in (*formats, "auto_round:auto_awq", "auto_round:awq"):
        layout = _config(bits=4, group_size=128, packing_format=fmt).layout
        layouts[fmt] = (layout.rule, layout.storage_format)
    assert layouts == {
        "auto_round:auto_gptq": ("gptq", "gptq"),
        "auto_round:gptq": ("gptq", "gptq"),
        "auto": ("gptq", "gptq"),
        "auto_round": ("gptq", "gptq_v2"),
        "auto_round:gptqmodel": ("gptq", "gptq_v2"),
        "auto_round:auto_awq": ("awq", "gemm"),
        "auto_round:awq": ("awq", "gemm"),
    }
    assert _config(bits=4, group_size=128).packing_format == "auto_round:auto_gptq"  # AutoRound's default
    with pytest.raises(CheckpointError, match=r"bits: expected 2, 3, 4, 8 bits .* found 5"):
        _config(bits=5, group_size=128)
    with pytest.raises(CheckpointError, match=r"extra_config.\"\[\": neither a layer name nor a regular expression"):
        _config(bits=4, group_size=128, extra_config={"[": {"bits": 8}})
