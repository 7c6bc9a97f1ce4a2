"""The corruption suite: every broken checkpoint raises a CheckpointError naming the file or the
tensor, with nothing half-loaded (no QuantLinear is built before the error)."""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_cache import (
    copy_checkpoint,
    ct_checkpoint,
    modelopt_fixture,
    single_threaded_torch,  # noqa: F401  (autouse)
)
from safetensors.torch import load_file, save_file

import qscheme.modules
from qscheme.checkpoint import load_checkpoint
from qscheme.checkpoint.inspect import inspect_checkpoint
from qscheme.cli.main import main
from qscheme.errors import CheckpointError

Q = "model.layers.0.self_attn.q_proj"
K = "model.layers.0.self_attn.k_proj"


def _rewrite(folder: Path, change: Callable[[dict[str, torch.Tensor]], None], file: str = "model.safetensors") -> None:
    path = folder / file
    tensors = {name: value.clone() for name, value in load_file(str(path)).items()}
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _header(path: Path) -> tuple[int, dict[str, dict[str, object]], bytes]:
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    return size, json.loads(data[8 : 8 + size]), data


def _write_header(path: Path, header: dict[str, object], size: int, data: bytes) -> None:
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= size, "the edited header must fit the original header space"
    path.write_bytes(data[:8] + raw.ljust(size) + data[8 + size :])


def truncated(folder: Path) -> None:
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])


def lying_offsets(folder: Path) -> None:
    path = folder / "model.safetensors"
    size, header, data = _header(path)
    entry = header[f"{Q}.weight_scale"]
    begin, end = entry["data_offsets"]  # type: ignore[misc]
    entry["data_offsets"] = [begin + 16, end + 16]
    _write_header(path, header, size, data)


def header_length_too_large(folder: Path) -> None:
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", len(data) * 2) + data[8:])


def missing_tensor(folder: Path) -> None:
    _rewrite(folder, lambda t: t.pop(f"{Q}.weight_scale"))


def unexpected_tensor(folder: Path) -> None:
    _rewrite(folder, lambda t: t.__setitem__(f"{Q}.weight_g_idx", torch.zeros(128, dtype=torch.int32)))


def wrong_dtype(folder: Path) -> None:
    _rewrite(folder, lambda t: t.__setitem__(f"{Q}.weight_scale", t[f"{Q}.weight_scale"].to(torch.float32)))


def wrong_shape(folder: Path) -> None:
    _rewrite(folder, lambda t: t.__setitem__(f"{Q}.weight_scale", t[f"{Q}.weight_scale"][:, :7].contiguous()))


def _set_global(value: float) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        _rewrite(folder, lambda t: t.__setitem__(f"{K}.weight_global_scale", torch.tensor([value])))

    return change


def nan_block_scale(folder: Path) -> None:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        raw = tensors[f"{Q}.weight_scale"].view(torch.uint8).clone()
        raw[3, 5] = 0x7F
        tensors[f"{Q}.weight_scale"] = raw.view(torch.float8_e4m3fn)

    _rewrite(folder, change)


def bad_config_json(folder: Path) -> None:
    path = folder / "config.json"
    path.write_text(
        path.read_text().replace('"quant_method": "compressed-tensors"', '"quant_method": compressed-tensors')
    )


def unknown_quant_algo(folder: Path) -> None:
    path = folder / "hf_quant_config.json"
    path.write_text(path.read_text().replace('"NVFP4"', '"NVFP4_TURBO"'))


def index_names_missing_shard(folder: Path) -> None:
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    tensors = load_file(str(folder / "model-00001-of-00002.safetensors"))
    weight_map = dict.fromkeys(tensors, "model-00001-of-00002.safetensors")
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    _rewrite(folder, lambda t: t.pop("lm_head.weight"), file="model-00001-of-00002.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def bad_weight_shape_values(folder: Path) -> None:
    _rewrite(folder, lambda t: t.__setitem__(f"{Q}.weight_shape", torch.tensor([128, -4], dtype=torch.int64)))


def e8m0_nan_scale(folder: Path) -> None:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[f"{Q}.weight_scale"][0, 0] = 0xFF

    _rewrite(folder, change)


def inf_fp8_weight_scale(folder: Path) -> None:
    _rewrite(folder, lambda t: t.__setitem__(f"{Q}.weight_scale", torch.tensor(float("inf"))))


def modelopt_zero_input_scale(folder: Path) -> None:
    _rewrite(folder, lambda t: t.__setitem__(f"{Q}.input_scale", torch.tensor(0.0)))


def negative_group_scale(folder: Path) -> None:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        scale = tensors[f"{Q}.weight_scale"].to(torch.float32)
        scale[1, 2] = -abs(float(scale[1, 2])) or -1.0
        tensors[f"{Q}.weight_scale"] = scale.to(torch.float8_e4m3fn)

    _rewrite(folder, change)


def empty_weight(folder: Path) -> None:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[f"{Q}.weight_packed"] = tensors[f"{Q}.weight_packed"][:0].clone()
        tensors[f"{Q}.weight_scale"] = tensors[f"{Q}.weight_scale"][:0].clone()

    _rewrite(folder, change)


def config_is_a_folder(folder: Path) -> None:
    (folder / "config.json").unlink()
    (folder / "config.json").mkdir()


def config_removed(folder: Path) -> None:
    (folder / "config.json").unlink()


def _edit_config(folder: Path, change: Callable[[dict[str, object]], None]) -> None:
    path = folder / "config.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def quantization_config_null(folder: Path) -> None:
    _edit_config(folder, lambda data: data.__setitem__("quantization_config", None))


def modelopt_without_any_config(folder: Path) -> None:
    (folder / "hf_quant_config.json").unlink()
    _edit_config(folder, lambda data: data.pop("quantization_config", None))


def duplicate_config_key(folder: Path) -> None:
    path = folder / "config.json"
    text = path.read_text().rstrip()
    assert text.endswith("}")
    path.write_text(text[:-1] + ', "quantization_config": null}')


def modelopt_group_size_32(folder: Path) -> None:
    path = folder / "hf_quant_config.json"
    path.write_text(path.read_text().replace('"group_size": 16', '"group_size": 32'))


def index_next_to_single_file(folder: Path) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    save_file(tensors, str(folder / "model-00001-of-00001.safetensors"))
    weight_map = dict.fromkeys(tensors, "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def stale_shard(folder: Path) -> None:
    index_next_to_single_file(folder)
    (folder / "model.safetensors").rename(folder / "model-00002-of-00002.safetensors")


def _replace_header(path: Path, raw: bytes) -> None:
    """A new header of any length before the same data section."""
    size, _, data = _header(path)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + size :])


def _edit_header(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def corrupt(folder: Path) -> None:
        path = folder / "model.safetensors"
        _, header, _ = _header(path)
        change(header)
        _replace_header(path, json.dumps(header).encode())

    return corrupt


def trailing_bytes(folder: Path) -> None:
    with (folder / "model.safetensors").open("ab") as handle:
        handle.write(bytes(16))


def duplicate_tensor_name(folder: Path) -> None:
    path = folder / "model.safetensors"
    _, header, _ = _header(path)
    entry = json.dumps(header[f"{Q}.weight_scale"])
    _replace_header(path, json.dumps(header)[:-1].encode() + f', "{Q}.weight_scale": {entry}}}'.encode())


def header_over_the_safetensors_cap(folder: Path) -> None:
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 100_000_001) + data[8:])


def index_shard_with_nul(folder: Path) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    weight_map = dict.fromkeys(tensors, "model-00001-of-00001.safetensors")
    weight_map["lm_head.weight"] = "model-00001-of-00001.safetensors\x00../../etc/passwd"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


CT = ("compressed-tensors", "NVFP4")
CASES: list[tuple[str, tuple[str, str], Callable[[Path], None], str]] = [
    ("truncated file", CT, truncated, r"model.safetensors: tensor '.*': data ends at byte \d+ .*file truncated"),
    (
        "header lies about offsets",
        CT,
        lying_offsets,
        r"model.safetensors: tensors '.*' and '.*' overlap|data ends at byte",
    ),
    ("header length too large", CT, header_length_too_large, r"model.safetensors: header length field says"),
    ("missing tensor", CT, missing_tensor, rf"tensor '{Q}.weight_scale': missing: scheme compressed-tensors/NVFP4"),
    ("unexpected tensor", CT, unexpected_tensor, rf"tensor '{Q}.weight_g_idx': unexpected for scheme"),
    ("wrong dtype", CT, wrong_dtype, rf"tensor '{Q}.weight_scale': expected dtype float8_e4m3fn, found float32"),
    ("wrong shape", CT, wrong_shape, rf"tensor '{Q}.weight_scale': expected shape \[N, K/16\] = \[128, 8\] for N=128"),
    (
        "zero global scale",
        CT,
        _set_global(0.0),
        rf"tensor '{K}.weight_global_scale': expected a finite scale > 0, found 0.0",
    ),
    ("NaN global scale", CT, _set_global(float("nan")), rf"tensor '{K}.weight_global_scale': .* found nan"),
    ("negative global scale", CT, _set_global(-3.0), rf"tensor '{K}.weight_global_scale': .* found -3.0"),
    (
        "NaN block scale",
        CT,
        nan_block_scale,
        rf"tensor '{Q}.weight_scale': expected finite scales, found 1 NaN/inf value \(first: nan at \[3, 5\]\)",
    ),
    ("bad JSON", CT, bad_config_json, r"config.json:\d+:\d+: invalid JSON"),
    (
        "empty weight",
        CT,
        empty_weight,
        rf"tensor '{Q}.weight_packed': expected a weight \[N, K/2\] with N >= 1 and K >= 1, found shape \[0, \d+\]",
    ),
    (
        "index names a missing shard",
        CT,
        index_names_missing_shard,
        r"names shard 'model-00002-of-00002.safetensors' .* does not exist",
    ),
    (
        "weight_shape values",
        ("compressed-tensors", "W4A16"),
        bad_weight_shape_values,
        rf"tensor '{Q}.weight_shape': expected two positive sizes",
    ),
    (
        "e8m0 NaN scale",
        ("compressed-tensors", "MXFP4A16"),
        e8m0_nan_scale,
        rf"tensor '{Q}.weight_scale': .*first: byte 0xFF at \[0, 0\]",
    ),
    (
        "inf FP8 scale",
        ("modelopt", "fp8"),
        inf_fp8_weight_scale,
        rf"tensor '{Q}.weight_scale': expected finite scales, found 1 NaN/inf",
    ),
    (
        "zero static input scale",
        ("modelopt", "fp8"),
        modelopt_zero_input_scale,
        rf"tensor '{Q}.input_scale': expected a finite scale > 0",
    ),
    (
        "unknown quant_algo",
        ("modelopt", "nvfp4"),
        unknown_quant_algo,
        r"hf_quant_config.json: quant_algo 'NVFP4_TURBO' is not known",
    ),
    (
        "negative group scale",
        CT,
        negative_group_scale,
        rf"tensor '{Q}.weight_scale': expected weight scales >= 0, found 1 negative value .* at \[1, 2\]",
    ),
    ("config.json is a folder", CT, config_is_a_folder, r"config.json: is a folder, not a file"),
    (
        "config.json removed",
        CT,
        config_removed,
        r"there is no config.json and no hf_quant_config.json, so every tensor would load as a plain tensor, "
        r"but module model.layers.0.mlp.down_proj \(and 6 more modules\) stores quantized-looking tensors",
    ),
    ("quantization_config null", CT, quantization_config_null, r"config.json's quantization_config is null"),
    (
        "ModelOpt tensors without any config",
        ("modelopt", "nvfp4"),
        modelopt_without_any_config,
        r"config.json has no quantization_config .* weight \(uint8 \[.*weight_scale_2 \(float32",
    ),
    ("duplicate key", CT, duplicate_config_key, r"config.json: key 'quantization_config' appears more than once"),
    (
        "ModelOpt group_size differs from the scheme's",
        ("modelopt", "nvfp4"),
        modelopt_group_size_32,
        r"hf_quant_config.json: quant_algo 'NVFP4' with group_size 32: scheme modelopt/NVFP4 stores one weight "
        r"scale per 16 weights",
    ),
    ("index next to model.safetensors", CT, index_next_to_single_file, r"has both model.safetensors.index.json"),
    ("stale shard", CT, stale_shard, r"shard file model-00002-of-00002.safetensors is in the folder but the index"),
    (
        "trailing bytes",
        CT,
        trailing_bytes,
        r"model.safetensors: the last tensor, '.*', ends at byte \d+ of the data section but the file has 16 more",
    ),
    (
        "tensor dropped from the header",
        CT,
        _edit_header(lambda h: h.pop(f"{Q}.weight_scale")),
        r"model.safetensors: bytes \d+-\d+ of the data section, after tensor '.*', belong to no tensor",
    ),
    ("duplicate tensor name", CT, duplicate_tensor_name, rf"key '{Q}.weight_scale' appears more than once"),
    (
        "boolean as a size",
        CT,
        _edit_header(lambda h: h[f"{Q}.weight_scale"].__setitem__("shape", [True, 8])),
        rf"tensor '{Q}.weight_scale': shape \[True, 8\] is not a list of sizes",
    ),
    (
        "metadata value not text",
        CT,
        _edit_header(lambda h: h.__setitem__("__metadata__", {"format": 1})),
        r"model.safetensors: __metadata__\['format'\] is a number",
    ),
    (
        "deeply nested header",
        CT,
        _edit_header(lambda h: h[f"{Q}.weight_scale"].__setitem__("x", json.loads("[" * 500 + "]" * 500))),
        rf"tensor '{Q}.weight_scale': JSON nested more than 64 levels deep",
    ),
    (
        "header over the safetensors cap",
        CT,
        header_over_the_safetensors_cap,
        r"header length field says 100,000,001 bytes, more than the 100,000,000 safetensors accepts",
    ),
    ("index shard name with NUL", CT, index_shard_with_nul, r"shard '.*\\x00.*' \(for 1 tensors, .*is not a file name"),
]


def _source(kind: tuple[str, str]) -> Path:
    producer, name = kind
    return ct_checkpoint(name) if producer == "compressed-tensors" else modelopt_fixture(name)


@pytest.mark.parametrize(("label", "kind", "corrupt", "pattern"), CASES, ids=[c[0] for c in CASES])
def test_corruption_raises_naming_the_tensor_or_file(
    label: str,
    kind: tuple[str, str],
    corrupt: Callable[[Path], None],
    pattern: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    folder = copy_checkpoint(_source(kind), tmp_path / "checkpoint")
    corrupt(folder)
    built: list[str] = []
    original = qscheme.modules.QuantLinear.from_canonical.__func__  # type: ignore[attr-defined]

    def counting(cls, weight, *args, **kwargs):  # type: ignore[no-untyped-def]
        built.append(kwargs.get("layer_name", "?"))
        return original(cls, weight, *args, **kwargs)

    monkeypatch.setattr(qscheme.modules.QuantLinear, "from_canonical", classmethod(counting))
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(folder)
    assert caught.value.args[0] and re.search(pattern, str(caught.value)), str(caught.value)
    assert str(folder) in str(caught.value)
    assert built == [], f"{label}: modules were built before the error: {built}"
    inspection = inspect_checkpoint(folder)
    assert not inspection.ok and inspection.problems


def test_all_problems_of_a_checkpoint_are_reported_together(tmp_path: Path) -> None:
    folder = copy_checkpoint(ct_checkpoint("NVFP4"), tmp_path / "checkpoint")
    missing_tensor(folder)
    wrong_dtype_other = f"{K}.weight_packed"
    _rewrite(folder, lambda t: t.__setitem__(wrong_dtype_other, t[wrong_dtype_other].to(torch.int32)))
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(folder)
    message = str(caught.value)
    assert "2 problem(s) found, nothing was loaded" in message
    assert f"{Q}.weight_scale" in message and wrong_dtype_other in message


def test_tolerated_tensors_are_dropped_not_errors() -> None:
    # modelopt W4A16_NVFP4 tolerates input_scale: the fixture has none, so add the case by
    # checking the compressed-tensors NVFP4A16 descriptor's tolerated input_global_scale.
    folder = ct_checkpoint("NVFP4A16")
    checkpoint = load_checkpoint(folder)
    assert checkpoint.report.tolerated_tensors == ()


def test_tolerated_input_global_scale_is_reported(tmp_path: Path) -> None:
    folder = copy_checkpoint(ct_checkpoint("NVFP4A16"), tmp_path / "checkpoint")
    _rewrite(folder, lambda t: t.__setitem__(f"{Q}.input_global_scale", torch.tensor([100.0])))
    checkpoint = load_checkpoint(folder)
    assert checkpoint.report.tolerated_tensors == (f"{Q}.input_global_scale",)
    assert f"{Q}.input_global_scale" not in checkpoint.tensors


def test_bias_problems_are_reported_by_inspect(tmp_path: Path) -> None:
    source = ct_checkpoint("NVFP4", attention_bias=True)
    nan_bias = copy_checkpoint(source, tmp_path / "nan")
    _rewrite(nan_bias, lambda t: t[f"{Q}.bias"].__setitem__(3, float("nan")))
    (problem,) = inspect_checkpoint(nan_bias).problems
    assert f"tensor '{Q}.bias': expected a finite bias, found 1 NaN/inf value (first: nan at [3])" in problem
    int_bias = copy_checkpoint(source, tmp_path / "int")
    _rewrite(int_bias, lambda t: t.__setitem__(f"{Q}.bias", t[f"{Q}.bias"].to(torch.int32)))
    (problem,) = inspect_checkpoint(int_bias).problems
    assert f"tensor '{Q}.bias': expected a float bias" in problem and "found int32" in problem
    with pytest.raises(CheckpointError, match=r"expected a float bias"):
        load_checkpoint(int_bias)


# Scales each finite, whose product the scheme cannot dequantize: check_values passes them, and
# only load's canonicalization (qscheme.scale_checks) refuses them. inspect runs it too.
UNDEQUANTIZABLE = [
    (("compressed-tensors", "NVFP4"), "weight_global_scale", 1e-37, "weight_packed", "weight_global_scale"),
    (("compressed-tensors", "NVFP4"), "weight_global_scale", 3e38, "weight_packed", "weight_global_scale"),
    (("modelopt", "fp8"), "weight_scale", 1e36, "weight", "weight_scale = 1e+36"),
    (("modelopt", "mxfp4"), "weight_scale", 254, "weight", "byte 0xFE"),
]


@pytest.mark.parametrize(
    ("kind", "scale", "value", "named", "said"),
    UNDEQUANTIZABLE,
    ids=["ct global tiny", "ct global huge", "modelopt fp8 huge", "modelopt mxfp4 2^127"],
)
def test_inspect_reports_scales_that_load_cannot_dequantize(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: tuple[str, str], scale: str, value: float, named: str,
    said: str,
) -> None:  # fmt: skip
    folder = copy_checkpoint(_source(kind), tmp_path / "checkpoint")
    _rewrite(folder, lambda t: t.__setitem__(f"{Q}.{scale}", torch.full_like(t[f"{Q}.{scale}"], value)))
    with pytest.raises(CheckpointError, match=rf"tensor '{Q}.{named}': layer {Q}, .*{re.escape(said)}"):
        load_checkpoint(folder)
    inspection = inspect_checkpoint(folder)
    assert not inspection.ok
    (problem,) = inspection.problems
    assert f"tensor '{Q}.{named}': layer {Q}" in problem and said in problem, problem
    assert main(["inspect", str(folder)]) == 1
    out = capsys.readouterr().out
    assert "problems (1):" in out and f"tensor '{Q}.{named}'" in out and "problems: none" not in out
