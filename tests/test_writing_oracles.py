"""``qscheme quantize`` against the producers' own whole-checkpoint writers, bit for bit.

The same small bf16 Llama-like checkpoint (tests/writing_checkpoints.py: 3 shards, q/k/v and
gate/up groups straddling shards, partitions of different magnitudes) is quantized by:

- llm-compressor's ``model_free_ptq`` (tests/llmcompressor_oracle.py, in its side venv) and
  ``qscheme quantize --scheme compressed-tensors/<preset>``, for NVFP4A16, W4A16, FP8_DYNAMIC and
  FP8 (static input scales: model_free_ptq has no data, so the oracle adds compressed-tensors' own
  input scale for the same per-module input amax qscheme reads from a calibration file);
- ModelOpt's ``mtq.quantize`` + ``export_hf_checkpoint`` (tests/writing_modelopt_export.py, in
  the ModelOpt venv) and ``qscheme quantize --scheme modelopt/W4A16_NVFP4`` / ``modelopt/FP8``
  (with the input amax ModelOpt's calibration observed, as a calibration file).

Every tensor (name, dtype, shape, bytes) must be identical, fused global scales included, and
the configs must say the same. Known differences, asserted as such: model_free_ptq quantizes any
2-D non-norm weight, embeddings included, so it is told to ignore ``model.embed_tokens`` (qscheme
never quantizes embeddings and does not list them); model_free_ptq moves fused partners into
the shard of the group's first member, qscheme keeps every tensor in its source shard.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from llmcompressor_oracle import OracleJob, oracle_python, run_model_free_ptq
from writing_checkpoints import (
    COPIED_FILES,
    FUSED_GROUPS,
    LlamaShape,
    qscheme_quantize,
    read_tensors,
    same_bytes,
    write_bf16_checkpoint,
)

CT_PRESETS = ("NVFP4A16", "W4A16", "FP8_DYNAMIC", "FP8")
ORACLE_IGNORE = ("lm_head", "model.embed_tokens")
MODELOPT_CONFIGS = {"W4A16_NVFP4": "W4A16_NVFP4_CFG", "FP8": "FP8_DEFAULT_CFG"}
MODELOPT_EXPORT = Path(__file__).parent / "writing_modelopt_export.py"


# --- checkpoints ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("writing") / "src"
    layout = write_bf16_checkpoint(folder)
    # the case this file exists for: fused groups whose members lie in different shards
    shard_of = {name: shard for shard, names in layout.items() for name in names}
    straddling = [
        members
        for i in range(LlamaShape().layers)
        for members in FUSED_GROUPS
        if len({shard_of[f"model.layers.{i}.{m}.weight"] for m in members}) > 1
    ]
    assert len(layout) == 3 and len(straddling) >= 2
    return folder


@pytest.fixture(scope="module")
def input_amax() -> dict[str, float]:
    """A different input amax per module, exact in bf16 (so no dtype path can round it)."""
    return {module: 0.75 + 0.25 * i for i, module in enumerate(LlamaShape().linear_modules())}


@pytest.fixture(scope="module")
def llmcompressor(source: Path, input_amax: dict[str, float]) -> dict[str, Path]:
    root = source.parent / "llmcompressor"
    jobs = [
        OracleJob(source, root / preset, preset, ORACLE_IGNORE, input_amax if preset == "FP8" else None)
        for preset in CT_PRESETS
    ]
    run_model_free_ptq(jobs)
    return {job.scheme: job.dst for job in jobs}


@pytest.fixture(scope="module")
def qscheme_ct(source: Path, input_amax: dict[str, float]) -> dict[str, Path]:
    root = source.parent / "qscheme-ct"
    calibration = source.parent / "calibration.json"
    calibration.write_text(json.dumps({"format": "qscheme-calibration/1", "input_amax": input_amax}))
    outputs = {}
    for preset in CT_PRESETS:
        extra = ("--calibration", str(calibration)) if preset == "FP8" else ()
        qscheme_quantize(source, root / preset, f"compressed-tensors/{preset}", *extra)
        outputs[preset] = root / preset
    return outputs


def assert_identical_tensors(ours: Path, theirs: Path, *, only_ours: set[str], only_theirs_prefix: str = "") -> None:
    mine, oracle = read_tensors(ours), read_tensors(theirs)
    assert set(mine) - set(oracle) == only_ours
    if only_theirs_prefix:
        assert all(name.startswith(only_theirs_prefix) for name in set(oracle) - set(mine))
    else:
        assert set(oracle) - set(mine) == set()
    different = [name for name in set(mine) & set(oracle) if not same_bytes(mine[name][1], oracle[name][1])]
    assert not different, sorted(different)[:10]


# --- llm-compressor ------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", CT_PRESETS)
@pytest.mark.oracle
def test_tensors_bit_identical_to_model_free_ptq(
    preset: str, qscheme_ct: dict[str, Path], llmcompressor: dict[str, Path]
) -> None:
    # the oracle was told to ignore the embedding (qscheme never quantizes one): both keep it bf16
    assert_identical_tensors(qscheme_ct[preset], llmcompressor[preset], only_ours=set())
    ours = read_tensors(qscheme_ct[preset])
    assert ours["model.embed_tokens.weight"][1].dtype == torch.bfloat16
    assert ours["lm_head.weight"][1].dtype == torch.bfloat16
    quantized = {name.rsplit(".", 1)[0] for name in ours if name.rsplit(".", 1)[1].startswith("weight_")}
    assert quantized == set(LlamaShape().linear_modules()) - {"lm_head"}


def test_fused_global_scales_are_llm_compressors_shared_ones(qscheme_ct: dict[str, Path]) -> None:
    from compressed_tensors.quantization.utils import generate_gparam

    tensors = read_tensors(qscheme_ct["NVFP4A16"])
    source = read_tensors(qscheme_ct["NVFP4A16"].parent.parent / "src")
    for layer in range(LlamaShape().layers):
        for members in FUSED_GROUPS:
            modules = [f"model.layers.{layer}.{member}" for member in members]
            scales = [tensors[f"{module}.weight_global_scale"][1] for module in modules]
            assert all(torch.equal(scale, scales[0]) for scale in scales), modules
            # each partition alone would get its own (different) global scale
            own = []
            for module in modules:
                weight = source[f"{module}.weight"][1]
                own.append(generate_gparam(weight.amin().reshape(1), weight.amax().reshape(1)))
            assert len({float(scale) for scale in own}) == len(members)
            assert torch.equal(scales[0], min(own, key=float))


@pytest.mark.parametrize("preset", CT_PRESETS)
@pytest.mark.oracle
def test_quantization_config_says_what_model_free_ptq_says(
    preset: str, qscheme_ct: dict[str, Path], llmcompressor: dict[str, Path]
) -> None:
    from compressed_tensors.quantization import QuantizationConfig

    ours = json.loads((qscheme_ct[preset] / "config.json").read_text())
    theirs = json.loads((llmcompressor[preset] / "config.json").read_text())
    parsed = [QuantizationConfig.model_validate(config["quantization_config"]) for config in (ours, theirs)]
    mine, oracle = (config.model_dump() for config in parsed)
    for config in (mine, oracle):
        config.pop("version", None)  # the compressed-tensors version each side writes
    # the group's name (qscheme: config_group_0, llm-compressor: the preset's name) carries no meaning
    assert [group for group in mine.pop("config_groups").values()] == list(oracle.pop("config_groups").values())
    # model_free_ptq was told to ignore the embedding; qscheme never quantizes one
    assert mine.pop("ignore") == ["lm_head"] and oracle.pop("ignore") == list(ORACLE_IGNORE)
    assert mine == oracle
    # everything else in config.json is the source's
    source = json.loads((qscheme_ct[preset].parent.parent / "src" / "config.json").read_text())
    ours.pop("quantization_config")
    assert ours == source


@pytest.mark.oracle  # the llmcompressor fixture runs llm-compressor in its side venv
def test_shards_index_and_copied_files(qscheme_ct: dict[str, Path], llmcompressor: dict[str, Path]) -> None:
    source_folder = qscheme_ct["NVFP4A16"].parent.parent / "src"
    source_shard = {name: shard for name, (shard, _) in read_tensors(source_folder).items()}
    for preset, folder in qscheme_ct.items():
        tensors = read_tensors(folder)
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        assert index["weight_map"] == {name: shard for name, (shard, _) in tensors.items()}
        assert index["metadata"]["total_size"] == sum(t.nbytes for _, t in tensors.values())
        # every tensor stays in the shard its source weight was in
        for name, (shard, _) in tensors.items():
            module = name.rsplit(".", 1)[0]
            origin = source_shard.get(name) or source_shard[f"{module}.weight"]
            assert shard == origin, (preset, name)
        for name in COPIED_FILES:
            assert (folder / name).read_bytes() == (source_folder / name).read_bytes(), name
        # model_free_ptq writes the same shard files (it moves fused partners between them)
        assert sorted(p.name for p in folder.glob("*.safetensors")) == sorted(
            p.name for p in llmcompressor[preset].glob("*.safetensors")
        )
        assert {p.name for p in folder.iterdir()} == {p.name for p in llmcompressor[preset].iterdir()}


# --- ModelOpt ------------------------------------------------------------------------------------


def modelopt_python() -> str:
    python = os.environ.get("QSCHEME_MODELOPT_PYTHON")
    if not python:
        pytest.skip("QSCHEME_MODELOPT_PYTHON is not set: run scripts/install-modelopt-oracle.sh and export it")
    return python


@pytest.fixture(scope="module")
def modelopt_exports(source: Path) -> dict[str, tuple[Path, Path]]:
    """ModelOpt's export per scheme, and the calibration file of the input amax it observed."""
    root = source.parent / "modelopt"
    root.mkdir()
    jobs = {
        name: {"config": config, "dst": str(root / name), "calibration": str(root / f"{name}.calibration.json")}
        for name, config in MODELOPT_CONFIGS.items()
    }
    spec = root / "spec.json"
    spec.write_text(json.dumps({"src": str(source), "jobs": list(jobs.values())}))
    completed = subprocess.run(
        [modelopt_python(), str(MODELOPT_EXPORT), str(spec)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TQDM_DISABLE": "1"},
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return {name: (Path(job["dst"]), Path(job["calibration"])) for name, job in jobs.items()}


@pytest.mark.parametrize("algorithm", list(MODELOPT_CONFIGS))
@pytest.mark.oracle
def test_tensors_bit_identical_to_modelopt_export(
    algorithm: str, source: Path, modelopt_exports: dict[str, tuple[Path, Path]]
) -> None:
    export, calibration = modelopt_exports[algorithm]
    ours = source.parent / f"qscheme-modelopt-{algorithm}"
    extra = ("--calibration", str(calibration)) if algorithm == "FP8" else ()
    qscheme_quantize(source, ours, f"modelopt/{algorithm}", *extra)
    assert_identical_tensors(ours, export, only_ours=set())
    tensors = read_tensors(ours)
    if algorithm == "W4A16_NVFP4":  # ModelOpt's export unifies weight_scale_2 over q/k/v and gate/up
        for layer in range(LlamaShape().layers):
            for members in FUSED_GROUPS:
                scales = {float(tensors[f"model.layers.{layer}.{m}.weight_scale_2"][1]) for m in members}
                assert len(scales) == 1
    else:
        assert sum(name.endswith(".input_scale") for name in tensors) == len(LlamaShape().linear_modules())
    # the configs say what ModelOpt's say; qscheme adds a note naming itself under "producer"
    for file_name in ("hf_quant_config.json", "config.json"):
        mine, theirs = (json.loads((folder / file_name).read_text()) for folder in (ours, export))
        if file_name == "config.json":
            mine, theirs = mine["quantization_config"], theirs["quantization_config"]
            assert sorted(mine.pop("ignore")) == sorted(theirs.pop("ignore"))
        else:
            excluded = [config["quantization"].pop("exclude_modules") for config in (mine, theirs)]
            assert sorted(excluded[0]) == sorted(excluded[1])
        assert mine["producer"].pop("note").startswith("quantized by qscheme")
        assert mine == theirs, file_name


def test_oracles_are_named_by_the_environment() -> None:
    """CI exports both; a run without them skips the comparisons above and says why."""
    if not os.environ.get("CI"):
        pytest.skip("only CI must name both oracles")
    assert oracle_python() and modelopt_python()
