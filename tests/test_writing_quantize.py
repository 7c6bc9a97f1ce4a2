"""quantize_checkpoint: every tensor written equals quantize_weight's for the same weight, with the
fused groups' shared global scale; configs load; calibration, refusals, safety and bad inputs."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
from compressed_tensors.quantization.utils import generate_gparam
from safetensors import safe_open
from test_writing_source import OTHER_FILES, llama_tensors, three_shards, write_source_checkpoint

import qscheme
from qscheme.errors import OutputError, QuantizeError, SchemeNotFoundError
from qscheme.writing.calibration import CALIBRATION_FORMAT, CalibrationError
from qscheme.writing.quantize import FUSED_SETS, quantize_checkpoint

FUSED = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


def _read_all(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            out.update({name: handle.get_tensor(name) for name in handle.keys()})
    return out


def _tree_digest(folder: Path) -> dict[str, str]:
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def _expected(
    tensors: dict[str, torch.Tensor], scheme: str, given_inputs: dict[str, dict[str, torch.Tensor]] | None = None
) -> dict[str, torch.Tensor]:
    """What each module should hold: quantize_weight per module, fused members given the global
    scale quantize_weight computes for the member with the largest absmax."""
    loaded = qscheme.load_scheme(scheme)
    global_name = loaded.weight.global_scale.tensor.name if loaded.weight.global_scale else None
    modules = [n.removesuffix(".weight") for n in tensors if ".layers." in n and n.endswith("proj.weight")]
    shared: dict[str, torch.Tensor] = {}
    if global_name is not None:
        for layer in sorted({m.split(".self_attn")[0].split(".mlp")[0] for m in modules}):
            for parent, members in FUSED:
                names = [f"{layer}.{parent}.{member}" for member in members]
                top = max(names, key=lambda n: float(tensors[n + ".weight"].float().abs().max()))
                value = qscheme.quantize_weight(tensors[top + ".weight"], scheme)[global_name]
                shared.update(dict.fromkeys(names, value))
    out: dict[str, torch.Tensor] = {}
    for module in modules:
        given = dict((given_inputs or {}).get(module, {}))
        if module in shared:
            given[global_name] = shared[module]  # type: ignore[index]
        for short, value in qscheme.quantize_weight(tensors[module + ".weight"], scheme, **given).items():
            out[f"{module}.{short}"] = value
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    )


WEIGHT_ONLY = [
    "compressed-tensors/NVFP4A16",
    "compressed-tensors/W4A16",
    "compressed-tensors/W4A16_ASYM",
    "compressed-tensors/FP8_DYNAMIC",
    "compressed-tensors/FP8_BLOCK",
    "compressed-tensors/W8A8",
    "modelopt/W4A16_NVFP4",
]


@pytest.mark.parametrize("scheme", WEIGHT_ONLY)
def test_every_tensor_is_quantize_weights_and_loads(tmp_path: Path, scheme: str) -> None:
    tensors = llama_tensors(num_layers=1)
    src = write_source_checkpoint(tmp_path / "src", tensors)
    summary = quantize_checkpoint(src, tmp_path / "dst", scheme)
    written = _read_all(tmp_path / "dst")
    expected = _expected(tensors, scheme)
    for name, value in expected.items():
        assert _same(written[name], value), name
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert _same(written[name], tensors[name])
    assert set(written) == set(expected) | {n for n in tensors if not n.endswith("proj.weight")}
    assert summary.layers_written == 7 and summary.scheme == scheme
    checkpoint = qscheme.load_checkpoint(tmp_path / "dst")
    assert len(checkpoint) == 7
    for module in checkpoint:
        tensors_of = {k.rpartition(".")[2]: v for k, v in expected.items() if k.rpartition(".")[0] == module}
        reference = qscheme.dequantize_weight(tensors_of, scheme)
        assert torch.equal(checkpoint[module].dequantize(), reference), module


def test_fused_group_spanning_shards_shares_the_libraries_global_scale(tmp_path: Path) -> None:
    tensors = llama_tensors(num_layers=2)
    shards = three_shards(tensors)
    src = write_source_checkpoint(tmp_path / "src", tensors, shards)
    before = _tree_digest(src)
    quantize_checkpoint(src, tmp_path / "dst", "compressed-tensors/NVFP4A16")
    assert _tree_digest(src) == before  # SRC untouched
    index = json.loads((tmp_path / "dst" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)}
    assert index["weight_map"]["model.layers.0.self_attn.q_proj.weight_packed"] == "model-00001-of-00003.safetensors"
    assert index["weight_map"]["model.layers.0.self_attn.k_proj.weight_packed"] == "model-00002-of-00003.safetensors"
    written = _read_all(tmp_path / "dst")
    for layer in (0, 1):
        for parent, members in FUSED:
            names = [f"model.layers.{layer}.{parent}.{member}" for member in members]
            joined = torch.cat([tensors[n + ".weight"] for n in names])
            library = generate_gparam(joined.amin(), joined.amax())  # compressed-tensors' own fused global scale
            for name in names:
                assert torch.equal(written[name + ".weight_global_scale"], library.reshape(1).float()), name
    for name, value in _expected(tensors, "compressed-tensors/NVFP4A16").items():
        assert _same(written[name], value), name
    for name in OTHER_FILES:
        assert (tmp_path / "dst" / name).read_bytes() == (src / name).read_bytes()


def test_fused_sets_cover_llama_attention_and_mlp() -> None:
    members = {tuple(group) for _, group in FUSED_SETS}
    assert ("q_proj", "k_proj", "v_proj") in members and ("gate_proj", "up_proj") in members


STATIC = {
    "compressed-tensors/FP8": {"input_scale": lambda a: a / 448.0},
    "compressed-tensors/NVFP4": {"input_global_scale": lambda a: generate_gparam(-a, a)},
    "modelopt/FP8": {"input_scale": lambda a: a / 448.0},
    "modelopt/NVFP4": {"input_scale": lambda a: a / 2688.0},
}


@pytest.mark.parametrize("scheme", sorted(STATIC))
def test_static_activation_schemes_need_calibration(tmp_path: Path, scheme: str) -> None:
    tensors = llama_tensors(num_layers=1)
    src = write_source_checkpoint(tmp_path / "src", tensors)
    with pytest.raises(CalibrationError, match=r"static activation scales.*--calibration"):
        quantize_checkpoint(src, tmp_path / "dst", scheme)
    assert not (tmp_path / "dst").exists() and list(tmp_path.iterdir()) == [src]
    modules = [n.removesuffix(".weight") for n in tensors if n.endswith("proj.weight")]
    amax = {module: 1.5 + index * 0.25 for index, module in enumerate(modules)}
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"format": CALIBRATION_FORMAT, "input_amax": amax}))
    quantize_checkpoint(src, tmp_path / "dst", scheme, calibration=calibration)
    written = _read_all(tmp_path / "dst")
    ((name, formula),) = STATIC[scheme].items()
    for module, value in amax.items():
        stored = written[f"{module}.{name}"].float().reshape(-1)
        reference = formula(torch.tensor(value, dtype=torch.float32)).reshape(-1)
        assert torch.equal(stored, reference.to(written[f"{module}.{name}"].dtype).float()), module
    given = {m: {name: formula(torch.tensor([a], dtype=torch.float32))} for m, a in amax.items()}
    for key, value in _expected(tensors, scheme, given).items():
        assert _same(written[key].reshape(value.shape), value), key
    assert len(qscheme.load_checkpoint(tmp_path / "dst")) == 7


def test_calibration_missing_a_module_is_refused(tmp_path: Path) -> None:
    src = write_source_checkpoint(tmp_path / "src", llama_tensors(num_layers=1))
    calibration = {"format": CALIBRATION_FORMAT, "input_amax": {"model.layers.0.self_attn.q_proj": 2.0}}
    with pytest.raises(CalibrationError, match=r"no input_amax for 6 module\(s\).*k_proj"):
        quantize_checkpoint(src, tmp_path / "dst", "compressed-tensors/FP8", calibration=calibration)
    assert not (tmp_path / "dst").exists()


def test_awq_is_refused(tmp_path: Path) -> None:
    src = write_source_checkpoint(tmp_path / "src", llama_tensors(num_layers=1))
    with pytest.raises(QuantizeError, match="activation-aware search"):
        quantize_checkpoint(src, tmp_path / "dst", "modelopt/W4A16_AWQ")


def test_existing_dst_needs_force(tmp_path: Path) -> None:
    src = write_source_checkpoint(tmp_path / "src", llama_tensors(num_layers=1))
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "old.txt").write_text("old")
    with pytest.raises(OutputError, match="already exists"):
        quantize_checkpoint(src, tmp_path / "dst", "compressed-tensors/W4A16")
    assert (tmp_path / "dst" / "old.txt").read_text() == "old"
    quantize_checkpoint(src, tmp_path / "dst", "compressed-tensors/W4A16", force=True)
    assert not (tmp_path / "dst" / "old.txt").exists() and (tmp_path / "dst" / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]
    with pytest.raises(OutputError, match="inside the source"):
        quantize_checkpoint(src, src / "out", "compressed-tensors/W4A16")


def _bad(tmp_path: Path, name: str, value: torch.Tensor) -> Path:
    tensors = llama_tensors(num_layers=1)
    tensors[name] = value
    return write_source_checkpoint(tmp_path / "src", tensors)


@pytest.mark.parametrize(
    ("name", "make", "scheme", "error", "match"),
    [
        (
            "model.layers.0.mlp.down_proj.weight",
            lambda: torch.zeros(128, 200, dtype=torch.bfloat16),
            "compressed-tensors/NVFP4A16",
            QuantizeError,
            r"'model.layers.0.mlp.down_proj.weight' has shape \[128, 200\]",
        ),
        (
            "model.layers.0.self_attn.o_proj.weight",
            lambda: torch.full((128, 128), float("nan"), dtype=torch.bfloat16),
            "compressed-tensors/NVFP4A16",
            QuantizeError,
            "'model.layers.0.self_attn.o_proj.weight'.*NaN",
        ),
        (
            "model.layers.0.self_attn.k_proj.weight",
            lambda: torch.full((64, 128), float("inf")),
            "compressed-tensors/NVFP4A16",
            QuantizeError,
            "'model.layers.0.self_attn.k_proj.weight'.*infinite",
        ),
        (
            "model.layers.0.mlp.up_proj.weight",
            lambda: torch.ones(256, 128, dtype=torch.int8),
            "compressed-tensors/W4A16",
            QuantizeError,
            "'model.layers.0.mlp.up_proj.weight' is int8",
        ),
    ],
)
def test_bad_input_is_a_typed_error_and_writes_nothing(
    tmp_path: Path,
    name: str,
    make,
    scheme: str,
    error: type[Exception],
    match: str,  # type: ignore[no-untyped-def]
) -> None:
    src = _bad(tmp_path, name, make())
    with pytest.raises(error, match=match):
        quantize_checkpoint(src, tmp_path / "dst", scheme)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no DST, no partial folder


def test_unknown_scheme(tmp_path: Path) -> None:
    src = write_source_checkpoint(tmp_path / "src", llama_tensors(num_layers=1))
    with pytest.raises(SchemeNotFoundError):
        quantize_checkpoint(src, tmp_path / "dst", "compressed-tensors/NOPE")
    assert not (tmp_path / "dst").exists()


def test_a_quantized_source_is_refused(tmp_path: Path) -> None:
    src = write_source_checkpoint(tmp_path / "src", llama_tensors(num_layers=1))
    quantize_checkpoint(src, tmp_path / "q", "compressed-tensors/W4A16")
    with pytest.raises(qscheme.CheckpointError, match="qscheme convert"):
        quantize_checkpoint(tmp_path / "q", tmp_path / "dst", "compressed-tensors/W4A16")


def test_ignore_patterns(tmp_path: Path) -> None:
    src = write_source_checkpoint(tmp_path / "src", llama_tensors(num_layers=2))
    summary = quantize_checkpoint(
        src,
        tmp_path / "dst",
        "compressed-tensors/W4A16",
        ignore=["lm_head", "re:.*\\.1\\.mlp\\..*", "*.o_proj", "nothing"],
    )
    quantized = {row.name for row in summary.layers if row.action == "quantized"}
    assert "model.layers.1.mlp.up_proj" not in quantized and "model.layers.0.mlp.up_proj" in quantized
    assert not any(name.endswith("o_proj") for name in quantized) and len(quantized) == 14 - 3 - 2
    assert "ignore entry 'nothing' matched no module" in summary.notes
    config = json.loads((tmp_path / "dst" / "config.json").read_text())["quantization_config"]
    # compressed-tensors knows exact names and re: patterns only: the wildcard is written as the
    # pattern it means, so every module left in 16 bits is ignored there too (and no other)
    assert config["ignore"][:2] == ["lm_head", "re:.*\\.1\\.mlp\\..*"] and config["ignore"][3] == "nothing"
    assert config["ignore"][2].startswith("re:")
    written = config["ignore"][2][3:]
    layers = [row.name for row in summary.layers if row.action in ("quantized", "copied")]
    assert {n for n in layers if re.match(written, n)} == {f"model.layers.{i}.self_attn.o_proj" for i in (0, 1)}
    assert len(qscheme.load_checkpoint(tmp_path / "dst")) == 14 - 3 - 2


def test_a_linear_named_like_an_embedding_is_quantized(tmp_path: Path) -> None:
    """GPT-NeoX's output head is ``embed_out``: a Linear, quantized like model_free_ptq does;
    ``embed_in`` (the embedding) is not."""
    tensors = {
        "gpt_neox.embed_in.weight": torch.randn(64, 128, dtype=torch.bfloat16),
        "gpt_neox.layers.0.mlp.dense_h_to_4h.weight": torch.randn(256, 128, dtype=torch.bfloat16),
        "embed_out.weight": torch.randn(64, 128, dtype=torch.bfloat16),
    }
    src = write_source_checkpoint(tmp_path / "src", tensors)
    summary = quantize_checkpoint(src, tmp_path / "dst", "compressed-tensors/W4A16")
    quantized = {row.name for row in summary.layers if row.action == "quantized"}
    assert quantized == {"gpt_neox.layers.0.mlp.dense_h_to_4h", "embed_out"}
