"""Run under a Python that has vLLM: vLLM's own Marlin prepare code as an oracle, on the CPU.

    python vllm_oracle.py IN.pt OUT.pt

IN.pt holds a list of cases (dicts, "path" naming the vLLM code to run); OUT.pt receives one dict
of tensors per case. Only torch and vllm are imported, never qscheme.

The prepare paths (``prepare_fp4_layer_for_marlin``, ``prepare_fp8_layer_for_marlin``,
``MarlinLinearKernel.process_weights_after_loading``) run as vLLM runs them on a bare module,
except the repack op, which is CUDA: ``ops.gptq_marlin_repack`` is replaced by vLLM's own Python
equivalent from its Marlin test utilities (``marlin_weights`` with ``get_weight_perm``, which
vLLM's kernel tests check the op against). The replacement also records the op's input.

The GPTQ and AWQ paths (``gptq``, ``awq``) run vLLM 0.33's own linear methods for those checkpoints
(``AutoGPTQLinearMethod``, ``AutoAWQMarlinLinearMethod``: its config read from the checkpoint's
``quantization_config``, ``create_weights``, the checkpoint's raw tensors copied into the parameters
it made, ``process_weights_after_loading``), with two stand-ins for what needs a GPU:
``choose_mp_linear_kernel`` returns ``MarlinLinearKernel`` (on a CPU vLLM would pick its CPU WNA16
kernel) and Marlin's support check is asked for compute capability 9.0. Those modules import
``compressed_tensors`` for their MoE paths, which this venv does not hold: an empty stand-in module
is put in its place, and anything in it raises if called. ``awq_marlin_repack``, which vLLM 0.33's
AWQ linear path no longer calls (it converts AWQ's packing in Python, then calls
``gptq_marlin_repack``), is replaced by a Python version of what vLLM documents for it (AWQ's
``[K, N/8]`` words, slots in the order 0, 2, 4, 6, 1, 3, 5, 7, repacked into the same tiles); every
call is recorded, and ``awq_repack`` runs it on given inputs.
"""

from __future__ import annotations

import logging
import sys
import types
from typing import Any

import torch

logging.disable(logging.WARNING)  # vLLM warns once per padded shape; nothing to see here

import vllm  # noqa: E402
import vllm._custom_ops as ops  # noqa: E402
from vllm.model_executor import parameter  # noqa: E402
from vllm.model_executor.kernels.linear.mixed_precision.marlin import MarlinLinearKernel  # noqa: E402
from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearLayerConfig  # noqa: E402
from vllm.model_executor.layers.quantization.utils import marlin_utils  # noqa: E402
from vllm.model_executor.layers.quantization.utils import marlin_utils_fp4 as fp4  # noqa: E402
from vllm.model_executor.layers.quantization.utils import marlin_utils_fp8 as fp8  # noqa: E402
from vllm.model_executor.layers.quantization.utils.marlin_utils_test import (  # noqa: E402
    get_weight_perm,
    marlin_weights,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import (  # noqa: E402
    unpack_quantized_values_into_int32,
)
from vllm.model_executor.parameter import (  # noqa: E402
    ChannelQuantScaleParameter,
    GroupQuantScaleParameter,
    PackedColumnParameter,
    PackedvLLMParameter,
)
from vllm.scalar_type import scalar_types  # noqa: E402

REPACK_INPUTS: list[torch.Tensor] = []


def python_repack(b_q_weight, size_k, size_n, num_bits, is_a_8bit=False, **_: Any):
    """gptq_marlin_repack by vLLM's Python test utilities (16-bit activations, no act-order)."""
    assert not is_a_8bit
    REPACK_INPUTS.append(b_q_weight.clone())
    unsigned = scalar_types.uint4 if num_bits == 4 else scalar_types.uint8
    values = unpack_quantized_values_into_int32(b_q_weight, unsigned, packed_dim=0)
    return marlin_weights(values, size_k, size_n, num_bits, get_weight_perm(num_bits))


AWQ_SLOTS = (0, 2, 4, 6, 1, 3, 5, 7)  # slot j of an AWQ word holds column AWQ_SLOTS[j] of its 8
AWQ_REPACK_CALLS: list[tuple[int, int, int]] = []


def python_awq_repack(b_q_weight, size_k, size_n, num_bits, is_a_8bit=False, **_: Any):
    """awq_marlin_repack: AWQ's [K, N/8] int32 words (slots in AWQ's order) into Marlin tiles."""
    assert not is_a_8bit and num_bits == 4
    AWQ_REPACK_CALLS.append((size_k, size_n, num_bits))
    shifts = torch.arange(0, 32, num_bits, dtype=torch.int32)
    slots = (b_q_weight.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)  # [K, N/8, 8] by slot
    columns = torch.empty_like(slots)
    columns[..., list(AWQ_SLOTS)] = slots  # by column within the word
    values = columns.reshape(size_k, size_n)
    return marlin_weights(values, size_k, size_n, num_bits, get_weight_perm(num_bits))


for module in (ops, fp4.ops, fp8.ops):
    module.gptq_marlin_repack = python_repack
ops.awq_marlin_repack = python_awq_repack
# One unsharded layer: vLLM's parameters ask for their tensor-parallel rank, which needs a process group.
parameter.get_tensor_model_parallel_rank = lambda: 0
parameter.get_tensor_model_parallel_world_size = lambda: 1


def _param(value: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(value, requires_grad=False)


def _outputs(layer: torch.nn.Module, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    out = {name: getattr(layer, name).data.clone() for name in names if getattr(layer, name, None) is not None}
    out["repack_input"] = REPACK_INPUTS[-1]
    return out


def run_fp4(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    layer = torch.nn.Module()
    n, k = case["n"], case["k"]
    layer.output_size_per_partition, layer.input_size_per_partition = n, k
    layer.params_dtype = case["dtype"]
    layer.weight = _param(case["weight"])
    layer.weight_scale = _param(case["weight_scale"])
    if case.get("global_scale") is not None:
        layer.weight_global_scale = _param(case["global_scale"])
    layer.bias = _param(case["bias"]) if case.get("bias") is not None else None
    fp4.prepare_fp4_layer_for_marlin(layer)
    return _outputs(layer, ("weight", "weight_scale", "weight_global_scale", "bias"))


def run_fp8(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    layer = torch.nn.Module()
    n, k = case["n"], case["k"]
    layer.output_size_per_partition, layer.input_size_per_partition = n, k
    layer.orig_dtype = case["dtype"]
    layer.logical_widths = case["partitions"]
    if case.get("block") is not None:
        layer.weight_block_size = case["block"]
    layer.weight = _param(case["weight"])
    layer.weight_scale = _param(case["weight_scale"])
    layer.bias = _param(case["bias"]) if case.get("bias") is not None else None
    fp8.prepare_fp8_layer_for_marlin(layer, size_k_first=False)
    return _outputs(layer, ("weight", "weight_scale", "bias"))


def run_int(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized (CompressedTensorsWNA16's parameters) through MarlinLinearKernel."""
    n, k, bits, group = case["n"], case["k"], case["bits"], case["group_size"]
    zero_points = case.get("weight_zero_point") is not None
    weight_type = {(4, False): scalar_types.uint4b8, (4, True): scalar_types.uint4, (8, False): scalar_types.uint8b128}
    config = MPLinearLayerConfig(
        full_weight_shape=(k, n),
        partition_weight_shape=(k, n),
        weight_type=weight_type[(bits, zero_points)],
        act_type=case["dtype"],
        group_size=group,
        zero_points=zero_points,
    )
    kernel = MarlinLinearKernel(config, "weight_packed", "weight_scale", "weight_zero_point")
    layer = torch.nn.Module()
    loader = lambda *args: None  # noqa: E731
    pack = 32 // bits
    layer.weight_packed = PackedvLLMParameter(
        input_dim=1, output_dim=0, packed_factor=pack, packed_dim=1, weight_loader=loader, data=case["weight_packed"]
    )
    if group == -1:
        layer.weight_scale = ChannelQuantScaleParameter(output_dim=0, weight_loader=loader, data=case["weight_scale"])
    else:
        layer.weight_scale = GroupQuantScaleParameter(
            output_dim=0, input_dim=1, weight_loader=loader, data=case["weight_scale"]
        )
    if zero_points:
        if group == -1:
            layer.weight_zero_point = PackedColumnParameter(
                output_dim=0, packed_dim=0, packed_factor=pack, weight_loader=loader, data=case["weight_zero_point"]
            )
        else:
            layer.weight_zero_point = PackedvLLMParameter(
                input_dim=1,
                output_dim=0,
                packed_dim=0,
                packed_factor=pack,
                weight_loader=loader,
                data=case["weight_zero_point"],
            )
    layer.bias = _param(case["bias"]) if case.get("bias") is not None else None
    kernel.process_weights_after_loading(layer)
    names = ("weight_packed", "weight_scale", "weight_zero_point", "bias")
    out = _outputs(layer, names if zero_points else names[:2] + names[3:])
    return out


def run_helpers(case: dict[str, Any]) -> dict[str, Any]:
    """Single helpers on given inputs: padding sizes, permutations, scale conversions."""
    out: dict[str, Any] = {
        "padded_nk": [marlin_utils.marlin_padded_nk(n, k, g) for n, k, g in case["shapes"]],
        "weight_perm_4": get_weight_perm(4),
        "weight_perm_8": get_weight_perm(8),
        "scale_perms": [torch.tensor(p) for p in marlin_utils.get_scale_perms()],
    }
    for name, (scales, size_k, size_n, group) in case["permute_scales"].items():
        out[f"permute_scales/{name}"] = marlin_utils.marlin_permute_scales(scales, size_k, size_n, group)
    for name, (zero_points, groups, size_n, bits) in case["zero_points"].items():
        out[f"zero_points/{name}"] = marlin_utils.marlin_zero_points(zero_points, groups, size_n, bits)
    for name, (scales, dtype) in case["nvfp4_scales"].items():
        processed, factor = fp4.nvfp4_marlin_process_scales(scales, a_dtype=dtype)
        out[f"nvfp4_scales/{name}"] = processed
        out[f"nvfp4_factor/{name}"] = factor
    for name, (global_scale, dtype) in case["nvfp4_global"].items():
        out[f"nvfp4_global/{name}"] = fp4.nvfp4_marlin_process_global_scale(global_scale, dtype)
    for name, scales in case["mxfp4_scales"].items():
        out[f"mxfp4_scales/{name}"] = fp4.mxfp4_marlin_process_scales(scales)
    for name, scales in case["fp8_scales"].items():
        out[f"fp8_scales/{name}"] = fp8.fp8_fused_exponent_bias_into_scales(scales)
    for name, bias in case["bias"].items():
        out[f"bias/{name}"] = marlin_utils.marlin_permute_bias(bias)
    for name, (packed, size_k, size_n, bits) in case["tiles"].items():
        out[f"tiles/{name}"] = python_repack(packed, size_k, size_n, bits)
    return out


class _AbsentModule(types.ModuleType):
    """Stands in for compressed_tensors, which vLLM's GPTQ/AWQ modules import for their MoE paths:
    every name is a class that raises when instantiated."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def refuse(*_: Any, **__: Any) -> None:
            raise RuntimeError(f"compressed_tensors.{name} was called: it is not installed in the vLLM oracle venv")

        value = type(name, (), {"__init__": refuse})
        setattr(self, name, value)
        return value


def _producer_modules() -> tuple[Any, Any]:
    """vLLM's auto_gptq and auto_awq modules, with the GPU-only choices replaced (see the docstring)."""
    for name in ("compressed_tensors", "compressed_tensors.quantization"):
        sys.modules.setdefault(name, _AbsentModule(name))
    from vllm.model_executor.layers.quantization import auto_awq, auto_gptq

    def verify_on_sm90(quant_type: Any, group_size: int, has_zp: bool = False) -> None:
        supported, message = marlin_utils._check_marlin_supported(quant_type, group_size, has_zp, device_capability=90)
        if not supported:
            raise ValueError(message)

    for module in (auto_gptq, auto_awq):
        module.choose_mp_linear_kernel = lambda config: MarlinLinearKernel
        module.verify_marlin_supported = verify_on_sm90
    return auto_gptq, auto_awq


def _run_linear_method(case: dict[str, Any], method: Any) -> dict[str, Any]:
    """create_weights, the checkpoint's tensors into its parameters, process_weights_after_loading."""
    n, k = case["n"], case["k"]
    layer = torch.nn.Module()
    method.create_weights(layer, k, [n], k, n, case["dtype"], weight_loader=lambda *args: None)
    made = {name: tuple(param.shape) for name, param in layer.named_parameters()}
    for name, tensor in case["tensors"].items():
        param = getattr(layer, name, None)
        if param is None:
            continue  # a checkpoint tensor the method makes no parameter for (GPTQ's g_idx)
        assert tuple(param.shape) == tuple(tensor.shape), (name, tuple(param.shape), tuple(tensor.shape))
        param.data.copy_(tensor)
    layer.bias = _param(case["bias"].to(case["dtype"])) if case.get("bias") is not None else None
    REPACK_INPUTS.clear()
    method.process_weights_after_loading(layer)
    config = method.kernel.config
    out: dict[str, Any] = {
        "parameters": made,
        "kernel": type(method.kernel).__name__,
        "weight_type": str(config.weight_type),
        "group_size": config.group_size,
        "zero_points": config.zero_points,
        "repack_input": REPACK_INPUTS[-1],
    }
    for name in ("qweight", "scales", "qzeros", "bias"):
        value = getattr(layer, name, None)
        if value is not None:
            out[name] = value.data.clone()
    return out


def run_gptq(case: dict[str, Any]) -> dict[str, Any]:
    """A GPTQ checkpoint's layer through vLLM's AutoGPTQLinearMethod (its config's refusal, if any)."""
    auto_gptq, _ = _producer_modules()
    try:
        method = auto_gptq.AutoGPTQLinearMethod(auto_gptq.AutoGPTQConfig.from_config(case["config"]))
    except ValueError as error:
        return {"error": str(error)}
    return _run_linear_method(case, method)


def run_awq(case: dict[str, Any]) -> dict[str, Any]:
    """An AWQ GEMM checkpoint's layer through vLLM's AutoAWQMarlinLinearMethod."""
    _, auto_awq = _producer_modules()
    AWQ_REPACK_CALLS.clear()
    method = auto_awq.AutoAWQMarlinLinearMethod(auto_awq.AutoAWQConfig.from_config(case["config"]))
    out = _run_linear_method(case, method)
    out["awq_repack_calls"] = len(AWQ_REPACK_CALLS)
    return out


def run_awq_repack(case: dict[str, Any]) -> dict[str, Any]:
    """The awq_marlin_repack stand-in on given AWQ words."""
    return {"tiles": python_awq_repack(case["qweight"], case["k"], case["n"], 4)}


RUNNERS = {
    "fp4": run_fp4,
    "fp8": run_fp8,
    "int": run_int,
    "helpers": run_helpers,
    "gptq": run_gptq,
    "awq": run_awq,
    "awq_repack": run_awq_repack,
}


def main() -> None:
    cases = torch.load(sys.argv[1])
    results = [RUNNERS[case["path"]](case) for case in cases]
    torch.save({"vllm_version": vllm.__version__, "results": results}, sys.argv[2])


if __name__ == "__main__":
    main()
