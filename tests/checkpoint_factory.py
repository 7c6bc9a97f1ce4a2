"""Write small compressed-tensors checkpoints with the compressed-tensors library itself.

A tiny LlamaForCausalLM (no download) is quantized with a compressed-tensors preset the way
peers.md describes: ``apply_quantization_config``, weight qparams from ``calculate_qparams``
(and ``generate_gparam`` for NVFP4 global scales, one per module, so q/k/v and gate/up get
different global scales, unlike llm-compressor), static activation scales from the input
absmax seen on a calibration batch, then ``ModelCompressor.compress_model`` and
``save_pretrained`` + ``update_config``.

Next to model.safetensors each folder gets ``reference.safetensors`` (never read by the
loader) with, per quantized linear: ``<module>.input`` (a fixed [1, 4, K] input) and
``<module>.output`` (the library's own fake-quantized forward on it, before compression), and
``tokens`` / ``logits``: the whole fake-quantized model's logits on fixed token ids.
Generation takes a fraction of a second per checkpoint.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import torch

os.environ.setdefault("TQDM_DISABLE", "1")

from compressed_tensors.compressors import BaseCompressor, ModelCompressor
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from compressed_tensors.quantization import (
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.lifecycle.forward import dequantize
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

CT_PRESETS = (
    "NVFP4",
    "NVFP4A16",
    "MXFP4",
    "MXFP4A16",
    "W4A16",
    "W4A16_ASYM",
    "W8A8",
    "FP8",
    "FP8_DYNAMIC",
    "FP8_BLOCK",
)
SEED = 1234
WEIGHT_MULTIPLIERS = {"self_attn.k_proj": 3.0, "self_attn.v_proj": 0.7, "mlp.gate_proj": 0.5}


def tiny_llama_config(num_layers: int = 1, attention_bias: bool = False) -> LlamaConfig:
    config = LlamaConfig(
        attention_bias=attention_bias,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,  # q [128, 128], k/v [64, 128]
        vocab_size=256,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    config.architectures = ["LlamaForCausalLM"]
    return config


def _weight_minmax(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    strategy = args.strategy
    if strategy == "tensor":
        return weight.amin().reshape(1), weight.amax().reshape(1)
    if strategy == "channel":
        return weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    if strategy in ("group", "tensor_group"):
        size = args.group_size
        view = weight.unflatten(-1, (weight.shape[-1] // size, size))
        return view.amin(-1), view.amax(-1)
    if strategy == "block":
        rows, cols = args.block_structure
        n, k = weight.shape
        padded = torch.zeros(-(-n // rows) * rows, -(-k // cols) * cols, dtype=weight.dtype)
        padded[:n, :k] = weight
        view = padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)
        return view.amin((1, 3)), view.amax((1, 3))
    raise ValueError(f"strategy {strategy} not handled by the factory")


def _input_absmax(model: torch.nn.Module) -> dict[str, float]:
    seen: dict[str, float] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):

            def hook(mod, args, name=name):  # type: ignore[no-untyped-def]
                seen[name] = max(seen.get(name, 0.0), float(args[0].detach().abs().max()))

            hooks.append(module.register_forward_pre_hook(hook))
    generator = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        model(torch.randint(0, 256, (2, 16), generator=generator))
    for handle in hooks:
        handle.remove()
    return seen


def build_model(
    num_layers: int = 1, dtype: torch.dtype = torch.float32, attention_bias: bool = False
) -> LlamaForCausalLM:
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(tiny_llama_config(num_layers, attention_bias)).eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            for suffix, factor in WEIGHT_MULTIPLIERS.items():
                if name.endswith(suffix):
                    module.weight.mul_(factor)
    return model.to(dtype)


def write_ct_checkpoint(
    preset: str,
    out: Path,
    *,
    dtype: torch.dtype = torch.float32,
    num_layers: int = 1,
    ignore: tuple[str, ...] = ("lm_head",),
    targets: tuple[str, ...] = ("Linear",),
    max_shard_size: str | None = None,
    attention_bias: bool = False,
) -> Path:
    """Quantize the tiny Llama with a preset and save it compressed into ``out``."""
    model = build_model(num_layers, dtype, attention_bias)
    if attention_bias:
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, torch.nn.Linear) and module.bias is not None:
                    module.bias.normal_(0.0, 0.05)
    absmax = _input_absmax(model)
    scheme = preset_name_to_scheme(preset, list(targets))
    with contextlib.redirect_stderr(io.StringIO()):
        apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore)))
    inputs: dict[str, torch.Tensor] = {}
    generator = torch.Generator().manual_seed(SEED + 2)
    with torch.no_grad():
        for name, module in model.named_modules():
            qscheme = getattr(module, "quantization_scheme", None)
            if qscheme is None or not isinstance(module, torch.nn.Linear):
                continue
            weight = module.weight.detach()
            global_scale = None
            if hasattr(module, "weight_global_scale"):
                global_scale = generate_gparam(weight.amin(), weight.amax(), dtype=torch.float32)
                module.weight_global_scale.data.copy_(global_scale.to(module.weight_global_scale.dtype))
                global_scale = module.weight_global_scale.data
            low, high = _weight_minmax(weight, qscheme.weights)
            scale, zero_point = calculate_qparams(low, high, qscheme.weights, global_scale=global_scale)
            module.weight_scale.data = scale.reshape(module.weight_scale.shape).to(module.weight_scale.dtype)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data = zero_point.reshape(module.weight_zero_point.shape).to(
                    module.weight_zero_point.dtype
                )
            amax = torch.tensor([absmax[name]])
            if hasattr(module, "input_global_scale"):
                module.input_global_scale.data.copy_(generate_gparam(-amax, amax).to(module.input_global_scale.dtype))
            if hasattr(module, "input_scale") and qscheme.input_activations is not None:
                input_scale, _ = calculate_qparams(-amax, amax, qscheme.input_activations)
                module.input_scale.data = input_scale.reshape(module.input_scale.shape).to(module.input_scale.dtype)
            x = torch.randn(1, 4, weight.shape[1], generator=generator) * (absmax[name] / 3.0)
            inputs[name] = x.to(dtype)
    reference: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, x in inputs.items():
            module = model.get_submodule(name)
            reference[f"{name}.input"] = x.to(torch.float32).contiguous()
            reference[f"{name}.output"] = module(x).to(torch.float32).contiguous()
        tokens = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(SEED + 3))
        reference["tokens"] = tokens
        reference["logits"] = model(tokens).logits.to(torch.float32).contiguous()
    compressor = ModelCompressor.from_pretrained_model(model)
    assert compressor is not None
    with contextlib.redirect_stderr(io.StringIO()):
        compressor.compress_model(model)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out), **kwargs)
    compressor.update_config(str(out))
    save_file(reference, str(out / "reference.safetensors"), metadata={"preset": preset})
    return out


# ---------------------------------------------------------------------------- the library's oracle


def _module_state(folder: Path, module: str) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    index = folder / "model.safetensors.index.json"
    files = (
        sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
        if index.is_file()
        else [folder / "model.safetensors"]
    )
    for path in files:
        with safe_open(str(path), "pt") as handle:
            for key in handle.keys():
                if key.startswith(module + ".") and "." not in key[len(module) + 1 :]:
                    state[key[len(module) + 1 :]] = handle.get_tensor(key)
    return state


def library_scheme(folder: Path) -> tuple[str, QuantizationScheme]:
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    group = config["config_groups"]["group_0"]
    fmt = group.get("format") or config["format"]
    return fmt, QuantizationScheme.model_validate({k: v for k, v in group.items() if k != "format"})


def library_dequantize(folder: Path, module: str, float32_path: bool = True) -> torch.Tensor:
    """compressed-tensors' own decompression of one module.

    ``float32_path``: 16-bit scales are upcast first so the library computes in float32 (its
    result cast to bf16 equals its bf16 result bit for bit, see peers.md); otherwise the result
    is the library's own model-dtype output, returned as float32.
    """
    fmt, scheme = library_scheme(folder)
    state = _module_state(folder, module)
    if float32_path:
        state = {k: v.to(torch.float32) if v.dtype in (torch.bfloat16, torch.float16) else v for k, v in state.items()}
    if fmt in ("nvfp4-pack-quantized", "mxfp4-pack-quantized") and float32_path:
        packed = state["weight_packed"]
        rows, columns = packed.shape
        values = unpack_fp4_from_uint8(packed, rows, columns * 2, dtype=torch.float32)
        scale = state["weight_scale"]
        if fmt == "mxfp4-pack-quantized":
            scale = BaseCompressor.get_value_from_registry(fmt)._decompress_scale(scale, torch.float32)
        else:
            scale = scale.to(torch.float32)
        return dequantize(
            x_q=values,
            scale=scale,
            args=scheme.weights,
            global_scale=state.get("weight_global_scale"),
            dtype=torch.float32,
        )
    compressor = BaseCompressor.get_value_from_registry(fmt)
    result = compressor.decompress(state, scheme)
    return result["weight"].to(torch.float32)
