"""NVFP4 weight quantization and dequantization speed: qscheme against compressed-tensors.

Both sides quantize the same 4096 x 4096 bfloat16 weight with the same global scale and are
timed on their normal CPU paths, alternating run by run so that both meet the same machine
load; outputs are compared bit for bit.

- compressed-tensors: scale observation (min/max per group, as llm-compressor's observer),
  ``calculate_qparams`` with the global scale, then ``NVFP4PackedCompressor.compress``; and its
  float32 decompression path (``unpack_fp4_from_uint8(dtype=float32)`` + ``dequantize``).
- qscheme: ``quantize_weight(weight, "compressed-tensors/NVFP4", weight_global_scale=...)`` and
  ``dequantize_weight``.

Run: ``python benchmarks/quant_speed.py [--size 4096] [--repeat 7]``.
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from typing import TypeVar

import torch

warnings.filterwarnings("ignore")


Result = TypeVar("Result")


def _timed(function: Callable[[], Result]) -> tuple[float, Result]:
    start = time.perf_counter()
    result = function()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096, help="N = K of the weight")
    parser.add_argument("--repeat", type=int, default=7, help="timed repetitions (median reported)")
    args = parser.parse_args()

    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    from loguru import logger

    from qscheme.catalog import load_scheme
    from qscheme.dequantize import dequantize_weight
    from qscheme.quantize import quantize_weight

    logger.disable("compressed_tensors")
    torch.manual_seed(0)
    weight = torch.randn(args.size, args.size, dtype=torch.bfloat16) * 0.02
    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    weight_args = scheme.weights
    flat = weight.reshape(1, 1, -1)
    global_scale = generate_gparam(torch.amin(flat, dim=(0, -1)), torch.amax(flat, dim=(0, -1)))

    def ct_quantize() -> dict[str, torch.Tensor]:
        groups = weight.unflatten(-1, (-1, weight_args.group_size)).unsqueeze(0)
        minimum, maximum = torch.amin(groups, dim=(0, -1)), torch.amax(groups, dim=(0, -1))
        scale, _ = calculate_qparams(minimum, maximum, weight_args, global_scale=global_scale)
        scale = scale.to(weight.dtype)  # the module's scale parameter has the weight's dtype
        state = {"weight": weight, "weight_scale": scale, "weight_global_scale": global_scale}
        return NVFP4PackedCompressor.compress(state, scheme)

    def ct_dequantize(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        packed = tensors["weight_packed"]
        values = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
        return dequantize(
            x_q=values,
            scale=tensors["weight_scale"].to(torch.float32),
            args=weight_args,
            global_scale=tensors["weight_global_scale"],
            dtype=torch.float32,
        )

    ours = load_scheme("compressed-tensors/NVFP4")  # like the preset above, looked up once

    def ours_quantize() -> dict[str, torch.Tensor]:
        return quantize_weight(weight, ours, weight_global_scale=global_scale)

    # warm up, then alternate the two libraries so that both meet the same machine load
    ct_tensors, our_tensors = ct_quantize(), ours_quantize()
    ct_weight, our_weight = ct_dequantize(ct_tensors), dequantize_weight(our_tensors, ours)
    times: dict[str, list[float]] = {"ct_q": [], "our_q": [], "ct_d": [], "our_d": []}
    for _ in range(args.repeat):
        seconds, ct_tensors = _timed(ct_quantize)
        times["ct_q"].append(seconds)
        seconds, our_tensors = _timed(ours_quantize)
        times["our_q"].append(seconds)
        seconds, ct_weight = _timed(functools.partial(ct_dequantize, ct_tensors))
        times["ct_d"].append(seconds)
        seconds, our_weight = _timed(functools.partial(dequantize_weight, our_tensors, ours))
        times["our_d"].append(seconds)
    ct_q_time, our_q_time, ct_d_time, our_d_time = (statistics.median(times[key]) for key in times)

    names = ("weight_packed", "weight_scale", "weight_global_scale")
    quantized_match = all(
        ct_tensors[name].dtype == our_tensors[name].dtype
        and torch.equal(ct_tensors[name].view(torch.uint8), our_tensors[name].view(torch.uint8))
        for name in names
    )
    # e2m1 code 0x8 (negative zero): compressed-tensors decodes it to -0.0, qscheme to +0.0
    dequantized_match = torch.equal((ct_weight + 0.0).view(torch.int32), (our_weight + 0.0).view(torch.int32))

    print(
        f"NVFP4 {args.size}x{args.size} bfloat16, median of {args.repeat}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}"
    )
    print(f"{'':14}{'compressed-tensors':>20}{'qscheme':>12}{'speed-up':>10}")
    print(
        f"{'quantize':14}{ct_q_time * 1e3:>17.1f} ms{our_q_time * 1e3:>9.1f} ms{ct_q_time / our_q_time:>9.1f}x"
        f"  {'MATCH' if quantized_match else 'MISMATCH'}"
    )
    print(
        f"{'dequantize':14}{ct_d_time * 1e3:>17.1f} ms{our_d_time * 1e3:>9.1f} ms{ct_d_time / our_d_time:>9.1f}x"
        f"  {'MATCH' if dequantized_match else 'MISMATCH'}"
    )


if __name__ == "__main__":
    main()
