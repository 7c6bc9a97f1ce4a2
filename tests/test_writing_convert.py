"""convert_checkpoint: whole checkpoints between producers, checked with the producers' libraries.

ModelOpt's own exports (tests/fixtures/modelopt) converted to compressed-tensors are read back
by the compressed-tensors library (its ModelCompressor config and its float32 decompression):
the weights equal ModelOpt's own dequantization bit for bit where the layer reports 0 ulps, and
deviate by exactly the reported ulps elsewhere. Converting back gives every tensor of the
original file bit for bit. compressed-tensors checkpoints written by the library convert to
ModelOpt and are dequantized by ModelOpt itself (side venv, skipped where absent). Refusals and
bad input write nothing and leave SRC untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from checkpoint_cache import ct_checkpoint, modelopt_fixture
from checkpoint_cache import single_threaded_torch as single_threaded_torch
from checkpoint_factory import library_dequantize
from ct_reference import ct_dequantize_float32
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qscheme.checkpoint import load_checkpoint
from qscheme.errors import OutputError, SchemeNotFoundError
from qscheme.writing.convert import ORIGINALS_KEY, NotQuantizedError, convert_checkpoint
from qscheme.writing.convert_deviation import ulp_distance
from qscheme.writing.convert_layer import RequantizationRefusedError

PAIRS = {
    "nvfp4": "compressed-tensors/NVFP4",
    "w4a16_nvfp4": "compressed-tensors/NVFP4A16",
    "fp8": "compressed-tensors/FP8",
}
MODELOPT_PYTHON = os.environ.get("QSCHEME_MODELOPT_PYTHON")


def source_copy(fixture: str, folder: Path) -> Path:
    """The ModelOpt export as ModelOpt wrote it (without the test's reference file)."""
    shutil.copytree(modelopt_fixture(fixture), folder, ignore=shutil.ignore_patterns("reference.safetensors"))
    return folder


def digest(folder: Path) -> str:
    sha = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        sha.update(path.name.encode())
        if path.is_file():
            sha.update(path.read_bytes())
    return sha.hexdigest()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def ct_library_dequantize(folder: Path, module: str) -> torch.Tensor:
    """compressed-tensors' float32 decompression of one module of a folder with one config group."""
    from compressed_tensors.quantization import QuantizationScheme

    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    (group,) = config["config_groups"].values()
    scheme = QuantizationScheme.model_validate({k: v for k, v in group.items() if k != "format"})
    scheme.format = group.get("format") or config["format"]
    state = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            for key in handle.keys():
                if key.startswith(module + ".") and "." not in key[len(module) + 1 :]:
                    state[key[len(module) + 1 :]] = handle.get_tensor(key)
    return ct_dequantize_float32(state, scheme)


def nothing_written(parent: Path, name: str) -> bool:
    return not any(entry.name.lstrip(".").startswith(name) for entry in parent.iterdir())


@pytest.mark.parametrize("fixture", list(PAIRS))
def test_modelopt_export_to_compressed_tensors_and_back(fixture: str, tmp_path: Path) -> None:
    from compressed_tensors.quantization import QuantizationConfig

    source = source_copy(fixture, tmp_path / "src")
    before = digest(source)
    summary = convert_checkpoint(source, tmp_path / "ct", PAIRS[fixture])
    assert digest(source) == before
    converted = tmp_path / "ct"
    config = json.loads((converted / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(config)  # the library takes the config as it is
    assert parsed.format == config["format"] and len(parsed.config_groups) == 1
    assert not (converted / "hf_quant_config.json").exists()
    reference = load_file(str(modelopt_fixture(fixture) / "reference.safetensors"))  # ModelOpt's dequantization
    rows = {row.name: row for row in summary.layers if row.action == "converted"}
    assert len(rows) == 7
    for module, row in rows.items():
        theirs = ct_library_dequantize(converted, module)
        found = int(ulp_distance(theirs, reference[module]).max())
        assert row.max_ulps == found, module
        assert row.max_abs_error == float((theirs - reference[module]).abs().max())
    if fixture == "fp8":
        assert all(row.max_ulps == 0 for row in rows.values())
    else:  # inverted global scales: the rounding shows in the report, and only there
        assert any(row.max_ulps for row in rows.values()) and any("inverted" in note for note in summary.notes)
        with safe_open(str(converted / "model.safetensors"), "pt") as handle:
            assert ORIGINALS_KEY in (handle.metadata() or {})

    algo = json.loads((source / "hf_quant_config.json").read_text())["quantization"]["quant_algo"]
    back = convert_checkpoint(converted, tmp_path / "back", f"modelopt/{algo}")
    original = load_file(str(source / "model.safetensors"))
    returned = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(original) == set(returned)
    for name in original:
        assert same_bits(returned[name], original[name]), name
    theirs = json.loads((source / "hf_quant_config.json").read_text())["quantization"]
    ours = json.loads((tmp_path / "back" / "hf_quant_config.json").read_text())["quantization"]
    assert {key: ours.get(key) for key in theirs} == theirs
    assert [row.max_ulps for row in back.layers] == [row.max_ulps for row in summary.layers]


def test_sharded_compressed_tensors_checkpoint_to_modelopt(tmp_path: Path) -> None:
    folder = ct_checkpoint("NVFP4", max_shard_size="100KB")
    summary = convert_checkpoint(folder, tmp_path / "mo", "modelopt/NVFP4")
    out = tmp_path / "mo"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == summary.shards and len(summary.shards) > 1
    source_index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert sorted(summary.shards) == sorted(set(source_index["weight_map"].values()))
    checkpoint = load_checkpoint(out)
    assert checkpoint.producer == "modelopt" and len(checkpoint) == 7
    for row in summary.layers:
        if row.action == "converted":
            theirs = library_dequantize(folder, row.name)
            assert int(ulp_distance(checkpoint[row.name].dequantize(), theirs).max()) == row.max_ulps


ORACLE = """
import sys, torch
from safetensors.torch import load_file
from modelopt.torch.quantization.qtensor import FP8QTensor, NVFP4QTensor
for source, result in zip(sys.argv[1::2], sys.argv[2::2]):
  tensors = load_file(source); out = {}
  for name in [n[: -len(".weight_scale")] for n in tensors if n.endswith(".weight_scale")]:
    w, s = tensors[name + ".weight"], tensors[name + ".weight_scale"]
    if w.dtype == torch.uint8:
      shape = (w.shape[0], w.shape[1] * 2)
      out[name] = NVFP4QTensor(shape, torch.float32, w).dequantize(
        dtype=torch.float32, scale=s, double_scale=tensors[name + ".weight_scale_2"], block_sizes={-1: 16})
    else:
      out[name] = FP8QTensor(w.shape, torch.float32, w).dequantize(dtype=torch.float32, scale=s)
  torch.save(out, result)
"""


@pytest.mark.skipif(not MODELOPT_PYTHON or not Path(MODELOPT_PYTHON).exists(), reason="no ModelOpt venv")
@pytest.mark.oracle
def test_compressed_tensors_to_modelopt_dequantized_by_modelopt(tmp_path: Path) -> None:
    written = {}
    for preset, target in (("NVFP4A16", "modelopt/W4A16_NVFP4"), ("FP8", "modelopt/FP8")):
        folder = ct_checkpoint(preset)
        out = tmp_path / preset
        summary = convert_checkpoint(folder, out, target)
        written[preset] = (folder, out, summary)
        save_file(load_file(str(out / "model.safetensors")), str(tmp_path / f"{preset}.safetensors"))
    script = tmp_path / "oracle.py"
    script.write_text(ORACLE)
    assert MODELOPT_PYTHON is not None
    arguments = [str(tmp_path / f"{preset}{suffix}") for preset in written for suffix in (".safetensors", ".pt")]
    subprocess.run([MODELOPT_PYTHON, str(script), *arguments], check=True, capture_output=True, timeout=300)
    for preset, (folder, _, summary) in written.items():
        modelopt = torch.load(tmp_path / f"{preset}.pt")
        for row in summary.layers:
            if row.action != "converted":
                continue
            theirs = library_dequantize(folder, row.name)  # compressed-tensors' own
            assert int(ulp_distance(modelopt[row.name], theirs).max()) == row.max_ulps, row.name
            if preset == "FP8":
                assert row.max_ulps == 0


def test_requantization_refused_writes_nothing_then_allowed(tmp_path: Path) -> None:
    source = source_copy("nvfp4", tmp_path / "src")
    before = digest(source)
    with pytest.raises(RequantizationRefusedError) as caught:
        convert_checkpoint(source, tmp_path / "int4", "compressed-tensors/W4A16")
    message = str(caught.value)
    for part in ("modelopt/NVFP4", "compressed-tensors/W4A16", "e2m1 -> int4", "--allow-requantize", "layer model."):
        assert part in message
    assert nothing_written(tmp_path, "int4") and digest(source) == before
    with pytest.raises(RequantizationRefusedError):  # activation quantization would be dropped
        convert_checkpoint(source, tmp_path / "a16", "compressed-tensors/NVFP4A16")
    summary = convert_checkpoint(source, tmp_path / "int4", "compressed-tensors/W4A16", allow_requantize=True)
    reference = load_file(str(modelopt_fixture("nvfp4") / "reference.safetensors"))
    rows = [row for row in summary.layers if row.action == "requantized"]
    assert len(rows) == 7
    for row in rows:
        theirs = ct_library_dequantize(tmp_path / "int4", row.name)  # compressed-tensors decompresses it
        assert row.max_abs_error == float((theirs - reference[row.name]).abs().max()) > 0
    assert digest(source) == before


def test_bad_input_writes_nothing(tmp_path: Path) -> None:
    source = source_copy("fp8", tmp_path / "src")
    before = digest(source)
    with pytest.raises(SchemeNotFoundError, match="no/SUCH"):
        convert_checkpoint(source, tmp_path / "out", "no/SUCH")
    plain = tmp_path / "plain"
    plain.mkdir()
    save_file({"model.layers.0.mlp.up_proj.weight": torch.zeros(8, 16)}, str(plain / "model.safetensors"))
    (plain / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(NotQuantizedError, match="qscheme quantize"):
        convert_checkpoint(plain, tmp_path / "out", "compressed-tensors/FP8")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(OutputError, match="already exists"):
        convert_checkpoint(source, tmp_path / "out", "compressed-tensors/FP8")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]
    assert not any(entry.name.startswith(".out") for entry in tmp_path.iterdir())
    assert digest(source) == before
    convert_checkpoint(source, tmp_path / "out", "compressed-tensors/FP8", force=True)
    assert (tmp_path / "out" / "config.json").exists() and not (tmp_path / "out" / "keep.txt").exists()


def test_unchanged_bytes_are_copied_from_the_source_file_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copied-through tensors and untouched codes go from the source file to the output by the
    kernel (recorded with their source range, which verify compares them with): no tensor is read."""
    import qscheme.writing.convert as convert_module
    from qscheme.writing.source import SourceCheckpoint

    folder = ct_checkpoint("NVFP4")
    records = []
    write_shard = convert_module.write_shard

    def recording(*args: object, **kwargs: object) -> object:
        record = write_shard(*args, **kwargs)  # type: ignore[arg-type]
        records.append(record)
        return record

    def no_reads(self: object, name: str) -> torch.Tensor:
        raise AssertionError(f"{name} was read into memory")

    monkeypatch.setattr(convert_module, "write_shard", recording)
    monkeypatch.setattr(SourceCheckpoint, "read", no_reads)
    summary = convert_checkpoint(folder, tmp_path / "mo", "modelopt/NVFP4")
    source = {}
    for path in folder.glob("*.safetensors"):
        source.update(load_file(str(path)))
    written = {t.name: t for record in records for t in record.tensors}
    converted = {row.name for row in summary.layers if row.action == "converted"}
    assert converted
    for name, tensor in written.items():
        module, _, short = name.rpartition(".")
        if module not in converted:  # copied through: the source's tensor, from its file
            assert tensor.same_as is not None and tensor.same_as[0].parent == folder, name
        elif short == "weight":  # the codes, untouched
            assert tensor.same_as is not None, name
            assert same_bits(
                load_file(str(tmp_path / "mo" / records[0].path.name))[name], source[f"{module}.weight_packed"]
            )
        elif short == "weight_scale_2":  # inverted: computed, checked by CRC-32
            assert tensor.same_as is None, name


@pytest.mark.parametrize("where", ["write", "verify"])
def test_a_failure_mid_write_leaves_no_dst_and_no_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """An interrupt in the main thread while a shard is written, or a failed re-read in a worker
    thread, ends the run with nothing at DST, no partial folder and no thread left behind."""
    import threading

    import qscheme.writing.convert as convert_module

    folder = ct_checkpoint("NVFP4", max_shard_size="100KB")
    before = digest(folder)
    calls = [0]
    name = "write_shard" if where == "write" else "verify_shard"
    original = getattr(convert_module, name)

    def failing(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        if calls[0] == 2:
            if where == "write":
                raise KeyboardInterrupt
            raise OutputError("the re-read found other bytes")
        return original(*args, **kwargs)

    monkeypatch.setattr(convert_module, name, failing)
    with pytest.raises(KeyboardInterrupt if where == "write" else OutputError):
        convert_checkpoint(folder, tmp_path / "mo", "modelopt/NVFP4")
    assert calls[0] >= 2
    assert nothing_written(tmp_path, "mo")
    assert digest(folder) == before
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("qscheme-convert")]
