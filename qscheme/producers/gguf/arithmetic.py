"""llama.cpp's quantization arithmetic for ``quantize_weight`` on ``gguf/<TYPE>`` schemes.

The blocks are llama.cpp's own (``qscheme.producers.gguf.quants``: bit for bit what
``llama-quantize`` writes without an importance matrix), from the float32 weight (a float16 or
bfloat16 weight is widened exactly first, as llama.cpp does). F32, F16 and BF16 are casts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qscheme.descriptor import Scheme
from qscheme.errors import QuantizeError
from qscheme.producers.gguf.quants import quantize_blocks, supported_types
from qscheme.producers.gguf.rule import NAME, rule_of
from qscheme.quantize.blocks import register_block_quantizer

# The float types: one value per block, rounded to nearest, ties to even (ggml's fp32 -> fp16 and
# fp32 -> bf16 conversions; a NaN stays a NaN): torch's casts round the same way.
FLOAT_TYPES: dict[str, torch.dtype] = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def quantizable_types() -> tuple[str, ...]:
    """The GGUF types qscheme writes as llama.cpp does: its quantizers' and the float casts."""
    return (*supported_types(), *FLOAT_TYPES)


def quantize_type(weight: Tensor, type_name: str, tensor_name: str = "the weight") -> Tensor:
    """uint8 [rows, row bytes] of GGUF type ``type_name`` for a float weight [rows, K]: llama.cpp's
    quantizer, or a cast for a float type; QuantizeError for a type qscheme cannot write exactly."""
    if type_name in FLOAT_TYPES:
        values = weight.to(torch.float32).to(FLOAT_TYPES[type_name]).contiguous()
        return values.view(torch.uint8).reshape(weight.shape[0], -1)
    if type_name not in supported_types():
        raise QuantizeError(
            f"{tensor_name}: qscheme cannot yet quantize to {type_name} bit for bit as llama.cpp does; "
            f"quantizable GGUF types: {', '.join(quantizable_types())}"
        )
    return quantize_blocks(weight.to(torch.float32).contiguous(), type_name, tensor_name=tensor_name)


def _quantize(scheme: Scheme, weight: Tensor) -> Tensor:
    rule = rule_of(scheme)
    if rule is None or len(rule.types) != 1:
        raise QuantizeError(f"scheme {scheme.name}: its detect.gguf rule must name one GGUF type to quantize to")
    return quantize_type(weight, rule.types[0], f"scheme {scheme.name}")


register_block_quantizer(NAME, _quantize)
