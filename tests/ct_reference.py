"""compressed-tensors' own quantization and float32 decompression of one Linear, as test oracles.

The quantization path is the library's real one: apply_quantization_config on a one-layer
model, qparams from llm-compressor's min/max observer arithmetic (min/max of every scale region
in the weight's dtype, fed to calculate_qparams / generate_gparam), then the compressor the
library picks for the preset (compress_module).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor, nn

warnings.filterwarnings("ignore")
from loguru import logger  # noqa: E402

logger.disable("compressed_tensors")

from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.compressors.base import compress_module  # noqa: E402
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32  # noqa: E402
from compressed_tensors.offload import update_offload_parameter  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationConfig,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.lifecycle.forward import dequantize  # noqa: E402
from compressed_tensors.quantization.utils import (  # noqa: E402
    calculate_qparams,
    generate_gparam,
    maybe_pad_tensor_for_block_quant,
)


def _observe(weight: Tensor, args) -> tuple[Tensor, Tensor]:  # type: ignore[no-untyped-def]
    """llm-compressor's flatten_for_calibration + min/max observer for weights."""
    strategy = args.strategy
    if strategy == "tensor":
        value = weight.reshape(1, 1, -1)
    elif strategy == "channel":
        value = weight.unsqueeze(-2).unsqueeze(0)
    elif strategy in ("group", "tensor_group"):
        value = weight.unflatten(-1, (-1, args.group_size)).unsqueeze(0)
    else:
        rows, columns = args.block_structure
        value = maybe_pad_tensor_for_block_quant(weight, args.block_structure)
        r, c = value.shape
        value = value.reshape(r // rows, rows, c // columns, columns).transpose(1, 2).flatten(-2, -1).unsqueeze(0)
    return torch.amin(value, dim=(0, -1)), torch.amax(value, dim=(0, -1))


def ct_quantize(weight: Tensor, preset: str, global_scale: Tensor | None = None) -> tuple[dict[str, Tensor], object]:
    """The compressed state dict of a Linear with this weight, and the preset's QuantizationScheme."""
    n, k = weight.shape
    model = nn.Sequential(nn.Linear(k, n, bias=False, dtype=weight.dtype))
    model[0].weight.data.copy_(weight)  # type: ignore[operator]
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])})
    apply_quantization_config(model, config, show_progress=False)
    layer: Any = model[0]
    args = layer.quantization_scheme.weights
    if args.strategy == "tensor_group":
        if global_scale is None:
            flat = weight.reshape(1, 1, -1)
            global_scale = generate_gparam(torch.amin(flat, dim=(0, -1)), torch.amax(flat, dim=(0, -1)))
        update_offload_parameter(layer, "weight_global_scale", global_scale)
    minimum, maximum = _observe(weight, args)
    scale, zero_point = calculate_qparams(
        minimum, maximum, args, global_scale=getattr(layer, "weight_global_scale", None)
    )
    update_offload_parameter(layer, "weight_scale", scale)
    if hasattr(layer, "weight_zero_point"):
        update_offload_parameter(layer, "weight_zero_point", zero_point)
    compress_module(layer)
    tensors = {name: value.detach().clone() for name, value in layer.state_dict().items()}
    return tensors, layer.quantization_scheme


def ct_dequantize_float32(tensors: dict[str, Tensor], scheme) -> Tensor:  # type: ignore[no-untyped-def]
    """The library's float32 decompression path (unpack and dequantize with dtype=float32)."""
    args = scheme.weights
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    if "weight_packed" in tensors and tensors["weight_packed"].dtype == torch.uint8:  # nvfp4 / mxfp4
        packed = tensors["weight_packed"]
        m, half = packed.shape
        values = unpack_fp4_from_uint8(packed, m, half * 2, dtype=torch.float32)
        scale = compressor._decompress_scale(tensors["weight_scale"], torch.float32)
        return dequantize(
            x_q=values, scale=scale, args=args, global_scale=tensors.get("weight_global_scale"), dtype=torch.float32
        )
    if "weight_packed" in tensors:  # pack-quantized
        shape = tensors["weight_shape"]
        scale = tensors["weight_scale"].to(torch.float32)
        zero_point = tensors.get("weight_zero_point")
        if zero_point is not None:
            if zero_point.shape[0] == 1:
                # compressed-tensors' decompression fails on a single row of packed zero points
                # (N <= 8 and several groups: "stride(-1) must be 1"); equal strides sidestep it
                zero_point = zero_point.contiguous().as_strided(zero_point.shape, (1, 1))
            zero_point = unpack_from_int32(zero_point, args.num_bits, (shape[0], scale.shape[-1]), packed_dim=0)
        values = unpack_from_int32(tensors["weight_packed"], args.num_bits, shape)
        return dequantize(x_q=values, scale=scale, zero_point=zero_point, args=args, dtype=torch.float32)
    return dequantize(
        x_q=tensors["weight"], scale=tensors["weight_scale"].to(torch.float32), args=args, dtype=torch.float32
    )
