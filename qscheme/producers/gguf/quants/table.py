"""The GGUF block types quantized here, as data: block shape and the function that fills blocks.

A type missing from this table is not reproduced bit for bit yet; ``quantize_blocks`` refuses it
and lists this table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from torch import Tensor

from qscheme.producers.gguf.quants import fp4, kquants, legacy, nonlinear


@dataclass(frozen=True)
class BlockQuantizer:
    """One ggml type: ``block_elements`` weights of a row stored in ``block_bytes`` bytes.

    ``quantize`` takes float32 blocks element-major, ``[block_elements, blocks]``, and returns
    uint8 ``[blocks, block_bytes]``: llama.cpp's bytes for them. ``reference`` names the C function
    of ggml-quants.c it mirrors.
    """

    name: str
    block_elements: int
    block_bytes: int
    quantize: Callable[[Tensor], Tensor]
    reference: str


QUANTIZERS: Mapping[str, BlockQuantizer] = MappingProxyType(
    {
        quantizer.name: quantizer
        for quantizer in (
            BlockQuantizer("Q4_0", 32, 18, legacy.quantize_q4_0, "quantize_row_q4_0_ref"),
            BlockQuantizer("Q4_1", 32, 20, legacy.quantize_q4_1, "quantize_row_q4_1_ref"),
            BlockQuantizer("Q5_0", 32, 22, legacy.quantize_q5_0, "quantize_row_q5_0_ref"),
            BlockQuantizer("Q5_1", 32, 24, legacy.quantize_q5_1, "quantize_row_q5_1_ref"),
            BlockQuantizer("Q8_0", 32, 34, legacy.quantize_q8_0, "quantize_row_q8_0_ref"),
            BlockQuantizer("Q2_K", 256, 84, kquants.quantize_q2_k, "quantize_row_q2_K_ref"),
            BlockQuantizer("Q3_K", 256, 110, kquants.quantize_q3_k, "quantize_row_q3_K_ref"),
            BlockQuantizer("Q4_K", 256, 144, kquants.quantize_q4_k, "quantize_row_q4_K_ref"),
            BlockQuantizer("Q5_K", 256, 176, kquants.quantize_q5_k, "quantize_row_q5_K_ref"),
            BlockQuantizer("Q6_K", 256, 210, kquants.quantize_q6_k, "quantize_row_q6_K_ref"),
            BlockQuantizer("IQ4_NL", 32, 18, nonlinear.quantize_iq4_nl, "quantize_iq4_nl"),
            BlockQuantizer("IQ4_XS", 256, 136, nonlinear.quantize_iq4_xs, "quantize_iq4_xs"),
            BlockQuantizer("MXFP4", 32, 17, fp4.quantize_mxfp4, "quantize_row_mxfp4_ref"),
            BlockQuantizer("NVFP4", 64, 36, fp4.quantize_nvfp4, "quantize_row_nvfp4_ref"),
        )
    }
)
