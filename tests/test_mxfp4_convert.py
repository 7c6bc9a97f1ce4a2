"""`qscheme convert` of a gpt-oss MXFP4 checkpoint to compressed-tensors MXFP4A16 (issue 27, point 6).

gpt-oss stacks every expert of a layer in one tensor per projection, gate and up rows interleaved
(tests/gpt_oss_checkpoint.py builds it from the documented layout). compressed-tensors stores one
linear per expert and projection: llm-compressor linearizes gpt-oss's experts into
``experts.<e>.gate_proj`` (the even rows of gate_up_proj), ``up_proj`` (the odd rows) and
``down_proj``, each with its bias (its ``GptOssLinearExperts``), so that is what convert writes.

The oracles: transformers' mxfp4 integration (``convert_moe_packed_tensors``) dequantizes the
source, compressed-tensors' own MXFP4 decompression reads the output, and transformers'
``GptOssForCausalLM`` runs the source checkpoint through its own loader. transformers itself does
not load a compressed-tensors gpt-oss with quantized experts (it has no conversion for gpt-oss's
experts: they stay at random init, a test below pins that), so the output is run through qscheme's
``apply_to_model`` and its ``from_pretrained`` route.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from gpt_oss_checkpoint import tiny_gpt_oss_config, write_gpt_oss_checkpoint
from gpt_oss_llmcompressor_oracle import write_with_llmcompressor
from safetensors.torch import load_file, save_file
from transformers import GptOssForCausalLM, Mxfp4Config
from transformers.integrations import mxfp4 as hf_mxfp4
from transformers.utils import logging as hf_logging

import qscheme
from qscheme.catalog import load_scheme
from qscheme.cli.main import main
from qscheme.errors import QSchemeError, UsageError
from qscheme.modules import QuantExperts
from qscheme.storage import TensorInfo
from qscheme.tensor_checks import ModuleLayout
from qscheme.transformers import via_qscheme
from qscheme.writing.convert_experts import check_splittable
from qscheme.writing.convert_layer import RequantizationRefusedError, UnconvertibleLayerError
from qscheme.writing.summary import WriteSummary

TARGET = "compressed-tensors/MXFP4A16"
# transformers' own dequantization (from 5.25, with triton and its kernels package on a CPU, it
# otherwise fetches Triton kernels from the Hub)
DEQUANTIZE = Mxfp4Config(dequantize=True)
TOKENS = torch.tensor([[1, 5, 9, 33, 2, 7, 100, 3, 64, 12]])
LAYERS, EXPERTS = 2, 4
INNER = tiny_gpt_oss_config().intermediate_size


def _experts(layer: int) -> str:
    return f"model.layers.{layer}.mlp.experts"


def _digest(folder: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gpt_oss_checkpoint(tmp_path_factory.mktemp("gpt_oss") / "src")


@pytest.fixture(scope="module")
def converted(source: Path) -> tuple[Path, WriteSummary, dict[str, str], dict[str, str]]:
    """(the converted folder, its summary, the source's file digests before and after)."""
    before = _digest(source)
    dst = source.parent / "ct"
    summary = qscheme.convert_checkpoint(source, dst, TARGET)
    return dst, summary, before, _digest(source)


@pytest.fixture(scope="module")
def expected(source: Path) -> dict[str, torch.Tensor]:
    """Every expert projection as transformers' mxfp4 integration dequantizes the source, [N, K],
    split as compressed-tensors stores it (gate: even rows of gate_up_proj, up: odd rows), and its bias."""
    state = load_file(source / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for layer in range(LAYERS):
        stacked = _experts(layer)
        for projection in ("gate_up_proj", "down_proj"):
            values = hf_mxfp4.convert_moe_packed_tensors(
                state[f"{stacked}.{projection}_blocks"], state[f"{stacked}.{projection}_scales"], dtype=torch.float32
            )
            bias = state[f"{stacked}.{projection}_bias"]
            for expert in range(EXPERTS):
                weight = values[expert].T  # transformers holds [K, N]
                module = f"{stacked}.{expert}"
                if projection == "down_proj":
                    out[f"{module}.down_proj"], out[f"{module}.down_proj.bias"] = weight, bias[expert]
                else:
                    out[f"{module}.gate_proj"], out[f"{module}.gate_proj.bias"] = weight[0::2], bias[expert, 0::2]
                    out[f"{module}.up_proj"], out[f"{module}.up_proj.bias"] = weight[1::2], bias[expert, 1::2]
    return out


@pytest.fixture(scope="module")
def source_logits(source: Path) -> torch.Tensor:
    """The source through transformers' own loader (it dequantizes mxfp4 on a CPU)."""
    hf_logging.set_verbosity_error()
    model = GptOssForCausalLM.from_pretrained(source, dtype=torch.float32, quantization_config=DEQUANTIZE).eval()
    with torch.no_grad():
        return model(TOKENS).logits


def test_every_expert_is_written_per_projection_with_codes_scales_and_biases_copied(
    source: Path, converted: tuple[Path, WriteSummary, dict[str, str], dict[str, str]]
) -> None:
    folder, summary, before, after = converted
    assert before == after  # the source is not modified
    written = load_file(folder / "model.safetensors")
    stored = load_file(source / "model.safetensors")
    for layer in range(LAYERS):
        stacked = _experts(layer)
        assert not [name for name in written if name.startswith(f"{stacked}.") and "_proj_" in name]
        for expert in range(EXPERTS):
            module = f"{stacked}.{expert}"
            blocks = stored[f"{stacked}.gate_up_proj_blocks"][expert].reshape(2 * INNER, -1)
            scales = stored[f"{stacked}.gate_up_proj_scales"][expert]
            bias = stored[f"{stacked}.gate_up_proj_bias"][expert]
            for member, rows in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
                assert torch.equal(written[f"{module}.{member}.weight_packed"], blocks[rows])
                assert torch.equal(written[f"{module}.{member}.weight_scale"], scales[rows])
                assert written[f"{module}.{member}.bias"].dtype == torch.bfloat16
                assert torch.equal(written[f"{module}.{member}.bias"], bias[rows])
            down = stored[f"{stacked}.down_proj_blocks"][expert]
            assert torch.equal(written[f"{module}.down_proj.weight_packed"], down.reshape(down.shape[0], -1))
            assert torch.equal(
                written[f"{module}.down_proj.weight_scale"], stored[f"{stacked}.down_proj_scales"][expert]
            )
            assert torch.equal(written[f"{module}.down_proj.bias"], stored[f"{stacked}.down_proj_bias"][expert])
    # everything else (attention, routers, sinks, norms, embeddings) as it was, bit for bit
    others = {name: value for name, value in stored.items() if not name.startswith(tuple(map(_experts, range(LAYERS))))}
    assert others and all(torch.equal(written[name], value) for name, value in others.items())
    per_expert = {name for name in written if ".mlp.experts." in name}
    assert len(per_expert) == LAYERS * EXPERTS * 3 * 3 and set(written) == per_expert | set(others)
    converted_rows = [row for row in summary.layers if row.action == "converted"]
    assert len(converted_rows) == LAYERS * EXPERTS * 3
    assert all(row.max_ulps == 0 and row.max_abs_error == 0 for row in converted_rows)
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "mxfp4-pack-quantized"
    assert "model.layers.1.mlp.router" in config["ignore"] and "model.layers.0.self_attn.q_proj" in config["ignore"]


def test_the_output_loads_back_to_the_same_dequantized_experts_bit_for_bit(
    converted: tuple[Path, WriteSummary, dict[str, str], dict[str, str]], expected: dict[str, torch.Tensor]
) -> None:
    checkpoint = qscheme.load_checkpoint(converted[0])
    assert {layer.scheme.name for layer in checkpoint.modules.values()} == {TARGET}
    weights = {name: value for name, value in expected.items() if not name.endswith(".bias")}
    assert sorted(checkpoint.modules) == sorted(weights)
    for name, weight in weights.items():
        layer = checkpoint[name]
        assert torch.equal(layer.dequantize(), weight), name
        assert torch.equal(layer.bias, expected[f"{name}.bias"]), name


def test_compressed_tensors_own_decompression_reads_the_same_weights(
    converted: tuple[Path, WriteSummary, dict[str, str], dict[str, str]], expected: dict[str, torch.Tensor]
) -> None:
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    folder = converted[0]
    (group,) = json.loads((folder / "config.json").read_text())["quantization_config"]["config_groups"].values()
    scheme = QuantizationScheme.model_validate({key: value for key, value in group.items() if key != "format"})
    compressor = BaseCompressor.get_value_from_registry(group["format"])
    tensors = load_file(folder / "model.safetensors")
    for name, weight in expected.items():
        if name.endswith(".bias"):
            continue
        state = {short: tensors[f"{name}.{short}"] for short in ("weight_packed", "weight_scale")}
        decompressed = compressor.decompress(state, scheme)["weight"]
        assert torch.equal(decompressed.float(), weight), name


def test_logits_through_the_converted_checkpoint_equal_the_source(
    source: Path, converted: tuple[Path, WriteSummary, dict[str, str], dict[str, str]], source_logits: torch.Tensor
) -> None:
    folder = converted[0]
    model = GptOssForCausalLM(tiny_gpt_oss_config()).eval()
    qscheme.apply_to_model(model, folder)
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts, QuantExperts) and experts.spec.interleaved
    assert experts.expert(0).gate_proj is not None and experts.expert(0).gate_up_proj is None
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS).logits, source_logits, rtol=0, atol=1e-5)
    hf_logging.set_verbosity_error()
    routed = GptOssForCausalLM.from_pretrained(folder, config=via_qscheme(folder), dtype=torch.float32).eval()
    assert isinstance(routed.model.layers[0].mlp.experts, QuantExperts)
    with torch.no_grad():
        torch.testing.assert_close(routed(TOKENS).logits, source_logits, rtol=0, atol=1e-5)


@pytest.mark.oracle  # its fixture runs the producer in a side venv
def test_llm_compressor_writes_the_same_checkpoint_from_the_dequantized_experts(
    source: Path, converted: tuple[Path, WriteSummary, dict[str, str], dict[str, str]], tmp_path: Path
) -> None:
    """llm-compressor's own writer (its gpt-oss linearization, ``oneshot`` MXFP4A16,
    ``save_pretrained``), given the experts as transformers dequantizes the source, writes the same
    per-expert tensors: names, shapes, dtypes and scales byte for byte, the same dequantized codes
    (it rounds the source's -0 codes to +0), the same biases and the same quantization config."""
    state = load_file(source / "model.safetensors")
    dense = {}
    for layer in range(LAYERS):
        for projection in ("gate_up_proj", "down_proj"):
            name = f"{_experts(layer)}.{projection}"
            dense[name] = hf_mxfp4.convert_moe_packed_tensors(
                state[f"{name}_blocks"], state[f"{name}_scales"], dtype=torch.float32
            ).contiguous()
            dense[f"{name}_bias"] = state[f"{name}_bias"].float()
    save_file(dense, str(tmp_path / "dense.safetensors"))
    write_with_llmcompressor(source, tmp_path / "dense.safetensors", tmp_path / "llmc")
    theirs, ours = load_file(tmp_path / "llmc" / "model.safetensors"), load_file(converted[0] / "model.safetensors")
    experts = sorted(name for name in theirs if ".mlp.experts." in name)
    assert experts == sorted(name for name in ours if ".mlp.experts." in name)
    for name in experts:
        assert theirs[name].shape == ours[name].shape, name
        if name.endswith(".bias"):  # their model ran in float32; the source's biases are bf16
            assert torch.equal(theirs[name], ours[name].float()), name
            continue
        assert theirs[name].dtype == ours[name].dtype == torch.uint8, name
        if name.endswith(".weight_scale"):
            assert torch.equal(theirs[name], ours[name]), name
        else:  # the same nibbles, except a -0 code (8) they write as +0
            for shift in (0, 4):
                mine, other = (ours[name] >> shift) & 15, (theirs[name] >> shift) & 15
                assert torch.equal(torch.where(mine == 8, 0, mine), other), name
    checkpoint, reference = qscheme.load_checkpoint(converted[0]), qscheme.load_checkpoint(tmp_path / "llmc")
    assert sorted(checkpoint.modules) == sorted(reference.modules)
    assert all(torch.equal(checkpoint[m].dequantize(), reference[m].dequantize()) for m in checkpoint.modules)
    mine_config = json.loads((converted[0] / "config.json").read_text())["quantization_config"]
    their_config = json.loads((tmp_path / "llmc" / "config.json").read_text())["quantization_config"]
    (their_group,) = their_config["config_groups"].values()
    (my_group,) = mine_config["config_groups"].values()
    assert my_group["format"] == their_group["format"] == "mxfp4-pack-quantized"
    assert my_group["targets"] == their_group["targets"] == ["Linear"]
    assert {key: their_group["weights"][key] for key in my_group["weights"]} == my_group["weights"]
    # the same modules left unquantized; convert also names the embedding (not a Linear: no effect)
    assert set(mine_config["ignore"]) - {"model.embed_tokens"} == set(their_config["ignore"])


def test_transformers_own_loader_leaves_per_expert_experts_unloaded(
    converted: tuple[Path, WriteSummary, dict[str, str], dict[str, str]],
) -> None:
    """Why the output is run through qscheme: transformers (no gpt-oss experts conversion for
    compressed-tensors) reports the experts missing and the per-expert tensors unexpected."""
    hf_logging.set_verbosity_error()
    _, info = GptOssForCausalLM.from_pretrained(converted[0], dtype=torch.float32, output_loading_info=True)
    assert "model.layers.0.mlp.experts.gate_up_proj" in info["missing_keys"]
    assert "model.layers.0.mlp.experts.0.gate_proj.weight_packed" in info["unexpected_keys"]


def test_the_cli_converts_and_reports_every_layer(source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    dst = tmp_path / "cli"
    assert main(["convert", str(source), str(dst), "--scheme", TARGET, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = [row for row in report["layers"] if row["action"] == "converted"]
    assert len(rows) == LAYERS * EXPERTS * 3 and {row["max_ulps"] for row in rows} == {0}
    assert "model.layers.1.mlp.experts.3.up_proj" in {row["name"] for row in rows}


def test_stacked_tensors_split_over_shards_convert(source: Path, tmp_path: Path) -> None:
    """A projection's blocks in one shard and its scales and bias in the next."""
    state = load_file(source / "model.safetensors")
    folder = tmp_path / "sharded"
    folder.mkdir()
    second = {name for name in state if name.endswith(("_scales", "_bias"))}
    shards = {
        "model-00001-of-00002.safetensors": {k: v for k, v in state.items() if k not in second},
        "model-00002-of-00002.safetensors": {k: v for k, v in state.items() if k in second},
    }
    weight_map = {}
    for file, tensors in shards.items():
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    index = {"metadata": {"total_size": sum(v.nbytes for v in state.values())}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text((source / "config.json").read_text())
    qscheme.convert_checkpoint(folder, tmp_path / "out", TARGET)
    written = qscheme.load_checkpoint(tmp_path / "out")
    original = qscheme.load_checkpoint(source)
    for expert in range(EXPERTS):
        module = f"{_experts(1)}.{expert}"
        fused = original[f"{module}.gate_up_proj"].dequantize()
        assert torch.equal(written[f"{module}.gate_proj"].dequantize(), fused[0::2])
        assert torch.equal(written[f"{module}.up_proj"].dequantize(), fused[1::2])


# ---------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("target", "error", "message"),
    [
        ("compressed-tensors/NVFP4A16", RequantizationRefusedError, r"changes the codes.*e8m0 -> e4m3"),
        ("compressed-tensors/MXFP4", RequantizationRefusedError, r"changes how inputs are quantized"),
        ("mxfp4/MXFP4", UsageError, r"mxfp4/MXFP4 is a scheme no producer writes"),
    ],
)
def test_targets_that_do_not_share_the_math_are_refused_and_nothing_is_written(
    source: Path, tmp_path: Path, target: str, error: type[QSchemeError], message: str
) -> None:
    with pytest.raises(error, match=message):
        qscheme.convert_checkpoint(source, tmp_path / "out", target)
    assert list(tmp_path.iterdir()) == []


def test_a_damaged_source_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    def narrow(state: dict[str, torch.Tensor]) -> None:
        name = f"{_experts(0)}.gate_up_proj_scales"
        state[name] = state[name][..., :-1].contiguous()

    folder = write_gpt_oss_checkpoint(tmp_path / "damaged", damage=narrow)
    with pytest.raises(QSchemeError, match=r"experts\.0\.gate_up_proj\.scales"):
        qscheme.convert_checkpoint(folder, tmp_path / "out", TARGET)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["damaged"]


def test_a_stacked_layer_whose_scales_span_rows_cannot_be_split() -> None:
    """Rows split only where every tensor is per row (or one value): 128 x 128 block scales are not."""

    def layout(scheme: str, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> ModuleLayout[TensorInfo]:
        declared = {
            short: TensorInfo(f"m.{short}", dtype, shape, Path("x.safetensors"))
            for short, (dtype, shape) in tensors.items()
        }
        return ModuleLayout("m", load_scheme(scheme), 256, 256, declared, (), None)

    members = ("gate_proj", "up_proj")
    check_splittable(
        "m", layout("mxfp4/MXFP4", {"blocks": ("uint8", (256, 128)), "scales": ("uint8", (256, 8))}), members
    )
    per_tensor = {"weight": ("float8_e4m3fn", (256, 256)), "weight_scale": ("float32", (1,))}
    check_splittable("m", layout("compressed-tensors/FP8", per_tensor), members)
    blocks = {"weight": ("float8_e4m3fn", (256, 256)), "weight_scale": ("float32", (2, 2))}
    with pytest.raises(UnconvertibleLayerError, match=r"layer m: .*stores 'weight_scale' as .* \(found \[2, 2\]\)"):
        check_splittable("m", layout("compressed-tensors/FP8_BLOCK", blocks), members)


def test_a_stored_tensor_named_like_a_split_expert_tensor_is_refused(tmp_path: Path) -> None:
    def stray(state: dict[str, torch.Tensor]) -> None:
        state[f"{_experts(1)}.2.down_proj.bias"] = torch.zeros(64, dtype=torch.bfloat16)

    folder = write_gpt_oss_checkpoint(tmp_path / "stray", damage=stray)
    # the source's plan refuses it (checkpoint.stacked_experts), before convert's own check would
    with pytest.raises(QSchemeError, match=r"'model\.layers\.1\.mlp\.experts\.2\.down_proj\.bias' is stored beside"):
        qscheme.convert_checkpoint(folder, tmp_path / "out", TARGET)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["stray"]
