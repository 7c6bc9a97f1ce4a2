"""Run under a Python that has nvidia-modelopt: ModelOpt's own export arithmetic as an oracle.

    python modelopt_oracle.py IN.pt OUT.pt

IN.pt holds a list of (quant_algo, weight) pairs; OUT.pt receives, per case, the tensors
ModelOpt's exporter writes for that weight (max calibration: amax = max|w|) and its own float32
dequantization where ModelOpt has one. Only torch and modelopt are imported, never qscheme.
"""

from __future__ import annotations

import sys

import torch
from modelopt.torch.export.quant_utils import pack_int4_in_uint8
from modelopt.torch.quantization.qtensor import FP8QTensor, MXFP4QTensor, NVFP4QTensor
from modelopt.torch.quantization.utils import reduce_amax, reduce_block_amax, reduce_block_padding

TINY = torch.finfo(torch.float32).tiny


def nvfp4(weight, group, second_level_divisor):
    amax = reduce_amax(weight).float()
    scale_2 = amax / second_level_divisor
    scale = NVFP4QTensor.get_weights_scaling_factor(weight, group, scale_2)[0]
    packed = NVFP4QTensor.quantize(weight, group, scale, scale_2)[0]._quantized_data
    dequantized = NVFP4QTensor(weight.shape, weight.dtype, packed).dequantize(
        dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: group}
    )
    return {"weight": packed, "weight_scale": scale, "weight_scale_2": scale_2}, dequantized


def run(algo, weight):
    if algo in ("NVFP4", "W4A16_NVFP4", "NVFP4_AWQ"):
        return nvfp4(weight, 16, 6.0 * 448.0)
    if algo == "W4A8_NVFP4_FP8":
        return nvfp4(weight, 32, 448.0)
    if algo == "FP8":
        scale = torch.tensor(reduce_amax(weight).float().item() / 448.0)
        data = (weight / scale).to(torch.float8_e4m3fn)
        dequantized = FP8QTensor(weight.shape, weight.dtype, data).dequantize(dtype=torch.float32, scale=scale)
        return {"weight": data, "weight_scale": scale}, dequantized
    if algo == "fp8_pb_wo":
        blocks = {-1: 128, -2: 128}
        amax = reduce_block_amax(reduce_block_padding(weight, blocks), blocks).float()
        scale = amax.clamp(min=TINY) / 448.0
        data = FP8QTensor.quantize(weight, scale, block_sizes=blocks)[0]._quantized_data
        dequantized = FP8QTensor(weight.shape, weight.dtype, data).dequantize(
            dtype=torch.float32, scale=scale, block_sizes=blocks
        )
        return {"weight": data, "weight_scale": scale}, dequantized
    if algo == "W4A16_AWQ":
        amax = reduce_block_amax(weight, {-1: 128}).float()
        scale = amax.clamp(min=TINY) / 7.0
        return {"weight": pack_int4_in_uint8(weight, scale, 128), "weight_scale": scale}, None
    if algo == "mxfp4":
        quantized, scale = MXFP4QTensor.quantize(weight, 32)
        scale = scale.reshape(*weight.shape[:-1], -1)
        dequantized = quantized.dequantize(dtype=torch.float32, scale=scale, block_sizes={-1: 32})
        return {"weight": quantized._quantized_data, "weight_scale": scale}, dequantized
    raise ValueError(algo)


def main() -> None:
    cases = torch.load(sys.argv[1])
    torch.save([run(algo, weight) for algo, weight in cases], sys.argv[2])


if __name__ == "__main__":
    main()
