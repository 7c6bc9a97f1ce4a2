"""Marlin for GPTQ and AWQ checkpoints, checked against vLLM's own GPTQ and AWQ linear methods.

The checkpoints are written by the producers' own libraries (GPTQModel 7.7.0 and AutoAWQ 0.2.9,
tests/gptq_oracle.py, ``QSCHEME_GPTQ_PYTHON``). vLLM 0.33's ``AutoGPTQLinearMethod`` and
``AutoAWQMarlinLinearMethod`` then read each layer's raw checkpoint tensors (``qweight``,
``scales``, ``qzeros``, ``g_idx``) in the vLLM oracle venv (tests/vllm_oracle.py,
``QSCHEME_VLLM_PYTHON``): their config from the checkpoint's ``quantization_config``, their
``create_weights``, the tensors copied into the parameters they made, and their
``process_weights_after_loading`` through ``MarlinLinearKernel``, with vLLM's Python stand-in for
the CUDA repack. qscheme loads the same checkpoint with ``load_checkpoint`` and prepares each
layer with its Marlin kernel (``MarlinKernel.prepare``; the repack op is qscheme's own
``marlin_tiles``, checked against vLLM's in tests/test_marlin_layout.py). The two must agree
tensor for tensor: the repacked weight, the permuted scales (bfloat16 and float16 activations),
the zero points, and the scalar type the GEMM runs (one layer of each shape per checkpoint; the
bias permutation is checked in tests/test_marlin_layout.py).

What vLLM 0.33 refuses, and what qscheme does instead:
- GPTQ act-order with groups (``desc_act: true``, ``g_idx`` out of order): vLLM's config raises
  ("no longer supported"; with channel scales act-order changes nothing and vLLM drops it, and its
  GPTQ method makes no ``g_idx`` parameter at all). qscheme loads it exactly onto the reference
  kernel; Marlin is rejected at the problem stage because it takes the input channels in order.
- Asymmetric GPTQ (``sym: false``): vLLM's GPTQ config raises (only ``uint4b8``/``uint8b128``).
  qscheme runs it on Marlin as ``uint4`` with zero points, as vLLM runs compressed-tensors'
  W4A16_ASYM: checked against vLLM's compressed-tensors Marlin path on qscheme's conversion of
  the same checkpoint to compressed-tensors (itself checked against compressed-tensors' own
  decompression in tests/test_gptq_awq_oracle.py).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from checkpoint_cache import single_threaded_torch  # noqa: F401  (autouse)
from gptq_oracle import build_checkpoints, oracle_python
from kernel_fakes import AS_IF_IMPLEMENTED, all_modules, builtin_schemes, fake_device
from qscheme_plugins import marlin_kernel
from qscheme_plugins import marlin_layout as ml
from safetensors.torch import load_file
from torch import Tensor

from qscheme.canonical import CanonicalWeight
from qscheme.checkpoint import load_checkpoint
from qscheme.kernels.devices import DeviceFacts
from qscheme.kernels.render import render_resolution
from qscheme.kernels.resolver import resolve
from qscheme.modules.problem import problem_for
from qscheme.writing.convert import convert_checkpoint

pytestmark = pytest.mark.oracle  # every test here: its module's fixture runs the producers in side venvs

VLLM_PYTHON = os.environ.get("QSCHEME_VLLM_PYTHON")
ORACLE = Path(__file__).with_name("vllm_oracle.py")
needs_vllm = pytest.mark.skipif(
    not VLLM_PYTHON, reason="set QSCHEME_VLLM_PYTHON to a Python with vLLM (bash scripts/oracle-venv.sh vllm)"
)
DTYPES = (torch.bfloat16, torch.float16)
MODEL = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "max_position_embeddings": 32,
    "tie_word_embeddings": False,
}
# One layer of each shape: [N, K] = [128, 128], [64, 128] (N at Marlin's smallest tile), [128, 256]
MODULES = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.mlp.down_proj")
# name -> (GPTQModel/AutoAWQ job, the qscheme scheme its layers load as, vLLM's scalar type or None: refused)
JOBS: dict[str, tuple[dict[str, Any], set[str], str | None]] = {
    "gptq_w4_g128": (
        {"kind": "gptq", "bits": 4, "group_size": 128, "sym": True, "checkpoint_format": "gptq"},
        {"gptq/W4A16"},
        "uint4b8",
    ),
    "gptq_v2_w4_g128": (
        {"kind": "gptq", "bits": 4, "group_size": 128, "sym": True, "checkpoint_format": "gptq_v2"},
        {"gptq_v2/W4A16"},
        "uint4b8",
    ),
    "gptq_w4_g32": (
        {"kind": "gptq", "bits": 4, "group_size": 32, "sym": True, "checkpoint_format": "gptq"},
        {"gptq/W4A16_G32"},
        "uint4b8",
    ),
    "gptq_w8_g128": (
        {"kind": "gptq", "bits": 8, "group_size": 128, "sym": True, "checkpoint_format": "gptq"},
        {"gptq/W8A16"},
        "uint8b128",
    ),
    "gptq_w8_channel": (
        {"kind": "gptq", "bits": 8, "group_size": -1, "sym": True, "checkpoint_format": "gptq"},
        {"gptq/W8A16_CHANNEL"},
        "uint8b128",
    ),
    "gptq_w4_channel": (
        {"kind": "gptq", "bits": 4, "group_size": -1, "sym": True, "checkpoint_format": "gptq"},
        {"gptq/W4A16_CHANNEL"},
        "uint4b8",
    ),
    "gptq_act_order": (
        {"kind": "gptq", "bits": 4, "group_size": 32, "sym": True, "checkpoint_format": "gptq", "act_order": True},
        {"gptq/W4A16_G32"},
        None,
    ),
    "gptq_asym_g128": (
        {"kind": "gptq", "bits": 4, "group_size": 128, "sym": False, "checkpoint_format": "gptq"},
        {"gptq/W4A16_ASYM"},
        None,
    ),
    "awq_g128": ({"kind": "awq", "bits": 4, "group_size": 128}, {"awq/W4A16_ASYM"}, "uint4"),
}
MARLIN_JOBS = [name for name, (_, _, scalar) in JOBS.items() if scalar is not None]
BUILTIN = {scheme.name for scheme in builtin_schemes()}


def declared(job: str) -> bool:
    """Whether qscheme declares the job's schemes (a GPTQ form whose scheme is added later is checked from then on)."""
    return JOBS[job][1] <= BUILTIN


REFUSED_BY_VLLM = {
    "gptq_act_order": "desc_act=True) is no longer supported",
    "gptq_asym_g128": "Unsupported quantization config: bits=4, sym=False",
}
ASYM_TARGET = "compressed-tensors/W4A16_ASYM"  # qscheme convert's target for asymmetric GPTQ


def dtype_name(dtype: torch.dtype) -> str:
    return "bf16" if dtype == torch.bfloat16 else "fp16"


# --- the checkpoints and vLLM's view of them -------------------------------------------------------


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every job's checkpoint, written by GPTQModel / AutoAWQ in one oracle process."""
    python = oracle_python()
    root = tmp_path_factory.mktemp("marlin_producers")
    jobs = [
        {**job, "dst": str(root / name), "model": MODEL, "seed": index}
        for index, (name, (job, _, _)) in enumerate(JOBS.items())
    ]
    build_checkpoints(jobs, python=python)
    paths = {name: root / name for name in JOBS}
    convert_checkpoint(paths["gptq_asym_g128"], root / "gptq_asym_g128_ct", ASYM_TARGET)
    paths["gptq_asym_g128_ct"] = root / "gptq_asym_g128_ct"
    return paths


def _module_tensors(folder: Path) -> dict[str, dict[str, Tensor]]:
    """module -> its stored tensors by short name (only modules with a packed weight)."""
    modules: dict[str, dict[str, Tensor]] = {}
    for name, tensor in load_file(folder / "model.safetensors").items():
        module, _, short = name.rpartition(".")
        modules.setdefault(module, {})[short] = tensor
    return {m: t for m, t in modules.items() if m in MODULES}


def _config(folder: Path) -> dict[str, Any]:
    import json

    return dict(json.loads((folder / "config.json").read_text())["quantization_config"])


def _oracle_cases(folders: dict[str, Path]) -> list[tuple[str, str, torch.dtype, dict[str, Any]]]:
    """(job, module, dtype, oracle case) for every quantized layer of every job, both dtypes."""
    cases = []
    for job in JOBS:
        path = "awq" if JOBS[job][0]["kind"] == "awq" else "gptq"
        config = _config(folders[job])
        for module, tensors in sorted(_module_tensors(folders[job]).items()):
            scales = tensors["scales"]
            n = scales.shape[1]
            k = tensors["qweight"].shape[0] * (1 if path == "awq" else 32 // int(config["bits"]))
            for dtype in DTYPES:
                case = {"path": path, "config": config, "n": n, "k": k, "dtype": dtype, "tensors": tensors}
                cases.append((job, module, dtype, case))
    # asymmetric GPTQ, converted by qscheme to compressed-tensors: vLLM's compressed-tensors Marlin path
    for module, tensors in sorted(_module_tensors(folders["gptq_asym_g128_ct"]).items()):
        n, packed = tensors["weight_packed"].shape
        for dtype in DTYPES:
            case = {
                "path": "int",
                "bits": 4,
                "group_size": 128,
                "n": n,
                "k": packed * 8,
                "dtype": dtype,
                "weight_packed": tensors["weight_packed"],
                "weight_scale": tensors["weight_scale"].to(dtype),
                "weight_zero_point": tensors["weight_zero_point"],
            }
            cases.append(("gptq_asym_g128_ct", module, dtype, case))
    return cases


def _awq_repack_case(folders: dict[str, Path]) -> dict[str, Any]:
    tensors = _module_tensors(folders["awq_g128"])["model.layers.0.mlp.down_proj"]
    k, words = tensors["qweight"].shape
    return {"path": "awq_repack", "qweight": tensors["qweight"], "k": k, "n": words * 8}


@pytest.fixture(scope="module")
def vllm_results(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """vLLM's outputs for every (job, module, dtype), from one oracle run."""
    if not VLLM_PYTHON:
        pytest.skip("set QSCHEME_VLLM_PYTHON to a Python with vLLM (bash scripts/oracle-venv.sh vllm)")
    cases = _oracle_cases(folders)
    folder = tmp_path_factory.mktemp("vllm-producers")
    torch.save([case for *_, case in cases] + [_awq_repack_case(folders)], folder / "in.pt")
    run = subprocess.run(
        [VLLM_PYTHON, str(ORACLE), str(folder / "in.pt"), str(folder / "out.pt")], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-4000:]
    out = torch.load(folder / "out.pt")
    results = out["results"]
    keyed = {(job, module, dtype): result for (job, module, dtype, _), result in zip(cases, results[:-1], strict=True)}
    return {"version": out["vllm_version"], "layers": keyed, "awq_repack": results[-1]}


# --- qscheme's Marlin state of the same layer ------------------------------------------------------


@pytest.fixture(scope="module")
def marlin() -> Iterator[marlin_kernel.MarlinKernel]:
    """qscheme's Marlin kernel bound to a stand-in for vLLM's ops whose repack is qscheme's own
    Python tiles (no vLLM in this venv; ``prepare`` only repacks)."""

    def repack(b_q_weight: Tensor, size_k: int, size_n: int, num_bits: int, is_a_8bit: bool) -> Tensor:
        assert not is_a_8bit
        return ml.marlin_tiles(b_q_weight, size_k, size_n, num_bits)

    ops = SimpleNamespace(gptq_marlin_repack=repack)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(marlin_kernel, "bind_vllm", lambda: (ops, None, "0.33.0"))
        yield marlin_kernel.MarlinKernel()


def _layers(folder: Path) -> dict[str, Any]:
    return {name: layer for name, layer in load_checkpoint(folder).modules.items() if name in MODULES}


def bits_equal(ours: Tensor, theirs: Tensor) -> bool:
    """Same dtype, shape and bytes."""
    if ours.dtype != theirs.dtype or ours.shape != theirs.shape:
        return False
    return torch.equal(ours.contiguous().view(torch.uint8), theirs.contiguous().view(torch.uint8))


def _check_layer(marlin: marlin_kernel.MarlinKernel, layer: Any, theirs: dict[torch.dtype, dict[str, Any]]) -> None:
    """qscheme's prepared Marlin GEMM of one layer equals vLLM's parameters for both dtypes."""
    weight: CanonicalWeight = layer.weight_canonical
    state = marlin.prepare(weight, torch.device("cpu"))
    (gemm,) = state.gemms
    names = (
        ("qweight", "scales", "qzeros")
        if "qweight" in theirs[DTYPES[0]]
        else ("weight_packed", "weight_scale", "weight_zero_point")
    )
    for dtype in DTYPES:
        vllm = theirs[dtype]
        ops = gemm.operands[dtype]
        assert bits_equal(gemm.weight, vllm[names[0]]), (dtype, "repacked weight")
        assert bits_equal(ops.scales, vllm[names[1]]), (dtype, "scales")
        if ops.zero_points is None:
            assert names[2] not in vllm or vllm[names[2]].numel() == 0, (dtype, "vLLM has zero points")
        else:
            assert bits_equal(ops.zero_points, vllm[names[2]]), (dtype, "zero points")
        if "weight_type" in vllm:
            assert ops.scalar_type == vllm["weight_type"], dtype
            assert vllm["kernel"] == "MarlinLinearKernel"


def test_the_checkpoints_load_as_the_schemes_expected(folders: dict[str, Path]) -> None:
    for name, (_, schemes, _) in JOBS.items():
        if not declared(name):
            continue
        modules = load_checkpoint(folders[name]).modules
        assert len(modules) == 7 and {layer.scheme.name for layer in modules.values()} == schemes, name


@needs_vllm
@pytest.mark.oracle
@pytest.mark.parametrize("job", MARLIN_JOBS)
def test_marlin_state_equals_vllms_linear_method(
    job: str, folders: dict[str, Path], vllm_results: dict[str, Any], marlin: marlin_kernel.MarlinKernel
) -> None:
    if not declared(job):
        pytest.skip(f"qscheme declares no scheme {sorted(JOBS[job][1])} yet")
    layers = _layers(folders[job])
    assert set(layers) == set(MODULES)
    for module, layer in layers.items():
        theirs = {dtype: vllm_results["layers"][(job, module, dtype)] for dtype in DTYPES}
        assert all(result["weight_type"] == JOBS[job][2] for result in theirs.values()), module
        _check_layer(marlin, layer, theirs)


@needs_vllm
@pytest.mark.oracle
def test_asymmetric_gptq_equals_vllms_compressed_tensors_marlin_of_its_conversion(
    folders: dict[str, Path], vllm_results: dict[str, Any], marlin: marlin_kernel.MarlinKernel
) -> None:
    """vLLM refuses asymmetric GPTQ; qscheme runs it as uint4 with zero points, as vLLM runs the
    same codes stored as compressed-tensors W4A16_ASYM."""
    layers = _layers(folders["gptq_asym_g128"])
    for module, layer in layers.items():
        theirs = {dtype: vllm_results["layers"][("gptq_asym_g128_ct", module, dtype)] for dtype in DTYPES}
        assert (
            marlin.prepare(layer.weight_canonical, torch.device("cpu")).gemms[0].operands[DTYPES[0]].scalar_type
            == "uint4"
        )
        _check_layer(marlin, layer, theirs)


@needs_vllm
@pytest.mark.oracle
@pytest.mark.parametrize("job", sorted(REFUSED_BY_VLLM))
def test_what_vllm_refuses(job: str, folders: dict[str, Path], vllm_results: dict[str, Any]) -> None:
    for (name, _, _), result in vllm_results["layers"].items():
        if name == job:
            assert REFUSED_BY_VLLM[job] in result["error"], result


def test_act_order_runs_on_cpu_gemv_here_and_on_the_reference_kernel_not_marlin_on_a_gpu(
    folders: dict[str, Path],
) -> None:
    """vLLM 0.33 refuses GPTQ act-order with groups; qscheme loads it exactly, on cpu_gemv on this
    CPU (which permutes its input), and a GPU with vLLM 0.33 would not pick Marlin for it (Marlin
    takes no permuted input): the reference kernel runs it there."""
    layers = _layers(folders["gptq_act_order"])
    device = replace(fake_device("sm90", modules=all_modules()), distributions=(("vllm", "0.33.0"),))
    for name, layer in layers.items():
        weight = layer.weight_canonical
        assert weight.input_permutation is not None, name
        assert layer.kernel.name == "cpu_gemv", name
        resolution = resolve(weight.scheme, problem_for(weight, "bfloat16", name), device, AS_IF_IMPLEMENTED)
        assert resolution.kernel is not None and resolution.kernel.name == "reference", render_resolution(resolution)
        marlin = resolution.candidate("marlin")
        assert not marlin.accepted and "permuted (GPTQ act-order" in marlin.reason, marlin.reason


def test_gptq_and_awq_layers_resolve_to_marlin_with_vllm_on_a_gpu(folders: dict[str, Path]) -> None:
    device: DeviceFacts = replace(fake_device("sm90", modules=all_modules()), distributions=(("vllm", "0.33.0"),))
    for job in [name for name in [*MARLIN_JOBS, "gptq_asym_g128"] if declared(name)]:
        for name, layer in _layers(folders[job]).items():
            weight = layer.weight_canonical
            for dtype in ("bfloat16", "float16"):
                resolution = resolve(weight.scheme, problem_for(weight, dtype, name), device, AS_IF_IMPLEMENTED)
                assert resolution.kernel is not None and resolution.kernel.name == "marlin", render_resolution(
                    resolution
                )


@needs_vllm
@pytest.mark.oracle
def test_awq_linear_path_never_calls_awq_marlin_repack_and_its_stand_in_agrees(
    vllm_results: dict[str, Any],
) -> None:
    """vLLM 0.33 converts AWQ's packing in Python and calls gptq_marlin_repack; the older op
    (``awq_marlin_repack``, stood in by its documented semantics) gives the same tiles."""
    awq = [result for (job, _, _), result in vllm_results["layers"].items() if job == "awq_g128"]
    assert awq and all(result["awq_repack_calls"] == 0 for result in awq)
    gate = vllm_results["layers"][("awq_g128", "model.layers.0.mlp.down_proj", torch.bfloat16)]
    assert bits_equal(vllm_results["awq_repack"]["tiles"], gate["qweight"])


@needs_vllm
@pytest.mark.oracle
def test_oracle_is_the_supported_vllm(vllm_results: dict[str, Any]) -> None:
    assert vllm_results["version"].startswith("0.33."), vllm_results["version"]
