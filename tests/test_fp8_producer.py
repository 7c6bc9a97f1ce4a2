"""The ``fp8`` producer (DeepSeek-style FP8 blocks): layout, exact dequantization, strictness,
conversion to compressed-tensors FP8_BLOCK and the kernel route.

No library writes these checkpoints on a CPU, so ``fp8_checkpoint`` writes them from DeepSeek's
documented layout; ``test_the_writer_follows_the_documented_layout`` pins that layout to the
cited facts and to transformers' own ``FP8Linear`` parameters. The dequantization is compared
with the published block formula written out below (per block of 128x128: float32(code) *
weight_scale_inv, then the target dtype), with transformers' own FP8 dequantization (it runs on a
CPU), and, after ``qscheme convert``, with compressed-tensors' own decompression.

Each strictness test reproduces a reported way these checkpoints load wrong (point 7 of issue
27) as a tiny checkpoint, and asserts a typed error naming the tensor and the rule.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from checkpoint_cache import single_threaded_torch  # noqa: F401
from fp8_checkpoint import E4M3_MAX, quantize_blocks, write_fp8_checkpoint
from kernel_fakes import isolated_plugins
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

import qscheme
from qscheme.cli.main import main
from qscheme.errors import CheckpointError, QSchemeError

# Ragged on purpose: 192 = 128 + 64 and 320 = 2 * 128 + 64, so every weight has partial blocks.
RAGGED = {"hidden_size": 192, "intermediate_size": 320, "num_attention_heads": 3, "head_dim": 64}
SHAPES = {  # module -> (N, K)
    "model.layers.0.self_attn.q_proj": (192, 192),
    "model.layers.0.self_attn.k_proj": (64, 192),
    "model.layers.0.self_attn.v_proj": (64, 192),
    "model.layers.0.self_attn.o_proj": (192, 192),
    "model.layers.0.mlp.gate_proj": (320, 192),
    "model.layers.0.mlp.up_proj": (320, 192),
    "model.layers.0.mlp.down_proj": (192, 320),
}
GATE = "model.layers.0.mlp.gate_proj"


def tiny_llama(seed: int = 0, **sizes: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        **{**RAGGED, **sizes},
        num_hidden_layers=1,
        num_key_value_heads=1,
        vocab_size=128,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture(scope="module")
def folder(model: LlamaForCausalLM, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fp8_checkpoint(tmp_path_factory.mktemp("fp8") / "ragged", model)


def published_dequantize(codes: torch.Tensor, scale_inv: torch.Tensor, block: int = 128) -> torch.Tensor:
    """DeepSeek-V3's formula: each 128x128 block of float32(codes) times its weight_scale_inv; the
    last row and column blocks are partial (the zero padding is removed after quantization)."""
    rows, columns = codes.shape
    out = torch.empty(rows, columns, dtype=torch.float32)
    for i in range(math.ceil(rows / block)):
        for j in range(math.ceil(columns / block)):
            r, c = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            out[r, c] = codes[r, c].to(torch.float32) * scale_inv[i, j]
    return out


def compressed_tensors_decompress(folder: Path, module: str, like: dict[str, torch.Tensor]) -> torch.Tensor:
    """compressed-tensors' own decompression of one module of a converted folder (float32 scales)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    (group,) = json.loads((folder / "config.json").read_text())["quantization_config"]["config_groups"].values()
    scheme = QuantizationScheme.model_validate({k: v for k, v in group.items() if k != "format"})
    tensors = load_file(str(folder / "model.safetensors"))
    state = {name.rpartition(".")[2]: tensor for name, tensor in tensors.items() if name.rpartition(".")[0] == module}
    assert sorted(state) == ["weight", "weight_scale"]  # compressed-tensors' name for weight_scale_inv
    return BaseCompressor.get_value_from_registry(group["format"]).decompress(state, scheme)["weight"].float()


def _edited(tmp_path: Path, model: LlamaForCausalLM, edit: object = None, **config: object) -> Path:
    return write_fp8_checkpoint(tmp_path / "damaged", model, edit=edit, **config)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- layout


def test_the_writer_follows_the_documented_layout(folder: Path) -> None:
    # DeepSeek-V3 README_WEIGHTS.md: quantization_config {"activation_scheme": "dynamic", "fmt": "e4m3",
    # "quant_method": "fp8", "weight_block_size": [128, 128]}; weight_scale_inv is a float32 tensor, one per
    # 128x128 block (ceil for partial blocks); everything else stays 16/32-bit.
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert config == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
    tensors = load_file(str(folder / "model.safetensors"))
    for module, (n, k) in SHAPES.items():
        assert tensors[f"{module}.weight"].dtype == torch.float8_e4m3fn
        assert tuple(tensors[f"{module}.weight"].shape) == (n, k)
        assert tensors[f"{module}.weight_scale_inv"].dtype == torch.float32
        assert tuple(tensors[f"{module}.weight_scale_inv"].shape) == (math.ceil(n / 128), math.ceil(k / 128))
    quantized = {f"{m}.{leaf}" for m in SHAPES for leaf in ("weight", "weight_scale_inv")}
    assert all(tensors[name].dtype == torch.float32 for name in set(tensors) - quantized)
    # transformers' FP8Linear, which its fp8 quantizer loads these tensors into, has the same parameters
    from transformers.integrations.finegrained_fp8 import FP8Linear

    with torch.device("meta"):
        layer = FP8Linear(in_features=192, out_features=320, block_size=(128, 128))
    assert (layer.weight.dtype, tuple(layer.weight.shape)) == (torch.float8_e4m3fn, (320, 192))
    assert (layer.weight_scale_inv.dtype, tuple(layer.weight_scale_inv.shape)) == (torch.float32, (3, 2))


def test_the_published_quantization_is_amax_over_448_per_zero_padded_block() -> None:
    weight = torch.zeros(130, 129)
    weight[0, 0], weight[129, 128], weight[5, 128] = 3.5, -7.0, 0.25
    codes, scale = quantize_blocks(weight)
    expected = torch.tensor([[3.5, 0.25], [E4M3_MAX, 7.0]]) / E4M3_MAX  # float32; an all-zero block keeps 1
    assert torch.equal(scale, expected)
    assert (float(codes[0, 0].float()), float(codes[129, 128].float()), float(codes[5, 128].float())) == (
        448,
        -448,
        448,
    )


# ---------------------------------------------------------------------------- exact dequantization


def test_weights_are_bit_identical_to_the_published_block_formula(folder: Path) -> None:
    layers = qscheme.load_checkpoint(folder, activation_dtype="float32")
    tensors = load_file(str(folder / "model.safetensors"))
    assert sorted(layers) == sorted(SHAPES)
    for module in SHAPES:
        layer = layers[module]
        assert layer.scheme.name == "fp8/FP8_BLOCK"
        expected = published_dequantize(tensors[f"{module}.weight"], tensors[f"{module}.weight_scale_inv"])
        assert torch.equal(layer.dequantize(), expected), module
        for dtype in (torch.bfloat16, torch.float16):
            assert torch.equal(layer.dequantize().to(dtype), expected.to(dtype)), (module, dtype)


def test_weights_equal_transformers_own_fp8_dequantization_where_it_reads_them(folder: Path) -> None:
    # transformers' Fp8Dequantize (its fp8 quantizer's CPU path) takes the block size from the scale grid,
    # so it reads only weights whose sides are whole multiples of the grid: 192x192 with a 2x2 grid is
    # read with 96x96 blocks (not DeepSeek's 128x128) and must then differ; 64x192 with a 1x2 grid is
    # read as 64x96, which is right only where the scales of both blocks are equal (never here).
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    theirs = Fp8Dequantize(hf_quantizer=None)
    tensors = load_file(str(folder / "model.safetensors"))
    aligned = torch.randn(256, 384, generator=torch.Generator().manual_seed(1))
    codes, scale = quantize_blocks(aligned)
    ours = published_dequantize(codes, scale)
    assert torch.equal(theirs._dequantize_one(codes, scale, output_dtype=torch.float32), ours)
    layers = qscheme.load_checkpoint(folder, activation_dtype="float32")
    q_proj = "model.layers.0.self_attn.q_proj"
    their_q = theirs._dequantize_one(
        tensors[f"{q_proj}.weight"], tensors[f"{q_proj}.weight_scale_inv"], output_dtype=torch.float32
    )
    assert not torch.equal(their_q, layers[q_proj].dequantize())  # their 96x96 blocks: a known limitation
    with pytest.raises(ValueError, match="not divisible by scale grid"):
        theirs._dequantize_one(tensors[f"{GATE}.weight"], tensors[f"{GATE}.weight_scale_inv"])


def test_ue8m0_scales_load_as_fp8_block_ue8m0_with_power_of_two_scales(model: LlamaForCausalLM, tmp_path: Path) -> None:
    folder = write_fp8_checkpoint(tmp_path / "ue8m0", model, scale_fmt="ue8m0")
    tensors = load_file(str(folder / "model.safetensors"))
    scale = tensors[f"{GATE}.weight_scale_inv"]
    assert scale.dtype == torch.float32 and torch.equal(torch.exp2(torch.log2(scale).round()), scale)
    layers = qscheme.load_checkpoint(folder, activation_dtype="float32")
    assert {layers[m].scheme.name for m in SHAPES} == {"fp8/FP8_BLOCK_UE8M0"}
    expected = published_dequantize(tensors[f"{GATE}.weight"], scale)
    assert torch.equal(layers[GATE].dequantize(), expected)


# ---------------------------------------------------------------------------- strictness (issue 27, point 7)


def _refused(folder: Path, *needles: str) -> str:
    with pytest.raises(QSchemeError) as caught:
        qscheme.load_checkpoint(folder)
    message = str(caught.value)
    for needle in needles:
        assert needle in message, (needle, message)
    return message


def test_a_dropped_weight_scale_inv_is_an_error_not_a_weight_200x_too_large(
    model: LlamaForCausalLM, tmp_path: Path
) -> None:
    folder = _edited(tmp_path, model, lambda t: t.pop(f"{GATE}.weight_scale_inv"))
    _refused(folder, GATE, "weight_scale_inv")


def test_a_scale_of_the_wrong_shape_is_an_error(model: LlamaForCausalLM, tmp_path: Path) -> None:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[f"{GATE}.weight_scale_inv"] = tensors[f"{GATE}.weight_scale_inv"][:2].contiguous()

    _refused(_edited(tmp_path, model, edit), GATE, "weight_scale_inv", "[2, 2]")


def test_an_orphan_scale_is_an_error(model: LlamaForCausalLM, tmp_path: Path) -> None:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.0.self_attn.rotary.weight_scale_inv"] = torch.ones(1, 1)

    _refused(_edited(tmp_path, model, edit), "model.layers.0.self_attn.rotary", "weight")


def test_a_16_bit_weight_beside_its_scale_is_an_error(model: LlamaForCausalLM, tmp_path: Path) -> None:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[f"{GATE}.weight"] = tensors[f"{GATE}.weight"].to(torch.bfloat16)

    _refused(_edited(tmp_path, model, edit), GATE, "bfloat16", "float8_e4m3fn")


def test_a_transposed_weight_is_an_error(model: LlamaForCausalLM, tmp_path: Path) -> None:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[f"{GATE}.weight"] = tensors[f"{GATE}.weight"].t().contiguous()

    _refused(_edited(tmp_path, model, edit), GATE, "weight_scale_inv")


def test_an_unconsumed_sidecar_tensor_is_an_error(model: LlamaForCausalLM, tmp_path: Path) -> None:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[f"{GATE}.input_scale"] = torch.tensor(0.5)

    _refused(_edited(tmp_path, model, edit), GATE, "input_scale")


def test_a_skipped_module_that_stores_fp8_codes_is_an_error(model: LlamaForCausalLM, tmp_path: Path) -> None:
    _refused(_edited(tmp_path, model, modules_to_not_convert=["mlp.gate_proj"]), GATE, "modules_to_not_convert")


def test_skipped_modules_match_as_transformers_matches_them(model: LlamaForCausalLM, tmp_path: Path) -> None:
    from qscheme.checkpoint.inspect import inspect_checkpoint

    # transformers' should_convert_module: a prefix up to a module boundary, a regex, or a suffix
    folder = _edited(tmp_path, model, modules_to_not_convert=["lm_head", "model.layers.1", "layers.0.self_attn.q"])
    report = inspect_checkpoint(folder, read_values=False)
    assert report.ignored == {"lm_head": "lm_head"}  # "model.layers.1" is not "model.layers.0" nor a prefix of it
    assert sorted(row.module for row in report.modules) == sorted(SHAPES)  # "...self_attn.q" is no module boundary
    folder = _edited(tmp_path / "regex", model, modules_to_not_convert=[r"model\.layers\.\d+\.self_attn\.k_proj"])
    _refused(folder, "model.layers.0.self_attn.k_proj", "modules_to_not_convert")


@pytest.mark.parametrize(
    ("config", "needles"),
    [
        ({"activation_scheme": "static"}, ("activation_scheme", "static", "dynamic")),
        ({"weight_block_size": None}, ("weight_block_size", "per tensor")),
        ({"weight_block_size": [64, 64]}, ("weight_block_size", "[64, 64]", "weight.scale.block")),
        ({"fmt": "e5m2"}, ("fmt", "e5m2", "e4m3")),
        ({"scale_fmt": "e4m3"}, ("scale_fmt", "ue8m0")),
        ({"expert_dtype": "fp4"}, ("expert_dtype", "fp4")),
    ],
)
def test_configs_qscheme_does_not_read_are_refused_with_the_key(
    model: LlamaForCausalLM, tmp_path: Path, config: dict[str, object], needles: tuple[str, ...]
) -> None:
    def set_config(folder: Path) -> None:
        path = folder / "config.json"
        whole = json.loads(path.read_text())
        whole["quantization_config"].update(config)
        path.write_text(json.dumps(whole))

    folder = write_fp8_checkpoint(tmp_path / "config", model)
    set_config(folder)
    with pytest.raises(CheckpointError) as caught:
        qscheme.load_checkpoint(folder)
    assert "config.json" in str(caught.value)
    for needle in needles:
        assert needle in str(caught.value), (needle, str(caught.value))


# ---------------------------------------------------------------------------- CLI, convert, kernels


def test_inspect_names_the_producer_and_scheme(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "producer: fp8" in out and "fp8/FP8_BLOCK: 7" in out and "problems: none" in out


def test_convert_to_compressed_tensors_fp8_block_copies_the_codes(folder: Path, tmp_path: Path) -> None:
    summary = qscheme.convert_checkpoint(folder, tmp_path / "ct", "compressed-tensors/FP8_BLOCK")
    converted = [row for row in summary.layers if row.action == "converted"]
    assert sorted(row.name for row in converted) == sorted(SHAPES)
    assert all(row.max_ulps == 0.0 for row in converted)
    source = load_file(str(folder / "model.safetensors"))
    for module in SHAPES:  # compressed-tensors' own decompression of the converted folder
        expected = published_dequantize(source[f"{module}.weight"], source[f"{module}.weight_scale_inv"])
        assert torch.equal(compressed_tensors_decompress(tmp_path / "ct", module, source), expected), module
    qscheme.convert_checkpoint(tmp_path / "ct", tmp_path / "back", "fp8/FP8_BLOCK")
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(back) == sorted(source)
    assert all(
        torch.equal(back[k].view(torch.uint8), source[k].view(torch.uint8))
        for k in source
        if k.endswith("weight") and source[k].dtype == torch.float8_e4m3fn
    )
    assert all(torch.equal(back[k], source[k]) for k in source if source[k].dtype != torch.float8_e4m3fn)
    config = json.loads((tmp_path / "back" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "fp8" and config["weight_block_size"] == [128, 128]


@pytest.mark.parametrize("device", ["cpu", "sm89", "sm90", "sm100", "sm120"])
def test_the_resolver_treats_fp8_block_as_compressed_tensors_fp8_block(
    device: str, capsys: pytest.CaptureFixture[str]
) -> None:
    traces = []
    with isolated_plugins():
        for scheme in ("fp8/FP8_BLOCK", "compressed-tensors/FP8_BLOCK"):
            code = main(["resolve", scheme, "--device", device])
            traces.append((code, capsys.readouterr().out.replace(scheme, "<scheme>")))
    assert traces[0] == traces[1]
    if device == "sm90":
        assert "kernel: native_fp8_block" in traces[0][1]
