"""bitsandbytes 4-bit dequantization, bit for bit as bitsandbytes computes it (0.50, CPU backend).

- The codes are the row-major [N, K] weight flattened, two per byte, element 2j in the high
  nibble (bitsandbytes packs ``(q[0::2] << 4) | q[1::2]``), the last byte padded when N*K is odd.
- A code's value is its entry of the quant type's table (``CODE_TABLES``: bitsandbytes' built-in
  tables, float32; the stored ``weight.quant_map`` is a copy bitsandbytes does not read back).
- ``weight = value * absmax[i // blocksize]`` for flat element i: one float32 product.
- With double quantization the absmax are restored first:
  ``absmax[j] = nested_quant_map[code_j] * nested_absmax[j // nested_blocksize]`` (float32),
  then ``+ nested_offset`` (float32): two roundings, in that order (``dequantize_blockwise``, then
  ``absmax += offset`` in ``bitsandbytes.functional.dequantize_4bit``).
- bitsandbytes then casts the float32 weight to the state's dtype once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qscheme.errors import CheckpointError
from qscheme.producers.bitsandbytes.quant_state import QuantState

_NF4 = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)  # fmt: skip
"""NF4: quantiles of N(0, 1) scaled to [-1, 1] (QLoRA), as bitsandbytes' ``get_4bit_type('nf4')`` lists them."""
_FP4_UNSCALED = (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, 0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0)
"""bitsandbytes' FP4 (1 sign, 2 exponent, 1 mantissa bits, exponent bias 2) by code, divided by 12
(its largest magnitude) in float32 as ``get_4bit_type('fp4')`` does. Code 8 (the sign bit alone) is
+0.0, as bitsandbytes' table and its CPU dequantization have it: a weight of code 8 is +0.0, never -0.0."""


def code_table(quant_type: str) -> Tensor:
    """The float32 value of each of the 16 codes of ``nf4`` or ``fp4``."""
    if quant_type == "nf4":
        return torch.tensor(_NF4, dtype=torch.float32)
    if quant_type == "fp4":
        values = torch.tensor(_FP4_UNSCALED, dtype=torch.float32)
        return values / values.abs().max()
    raise CheckpointError(f"bitsandbytes quant_type {quant_type!r}: expected 'nf4' or 'fp4'")


def check_quant_map(tensor: str, quant_map: Tensor, quant_type: str) -> None:
    """The stored table must be the built-in one bitsandbytes decodes with (it never reads this copy):
    a file whose copy differs means one thing to bitsandbytes and another to a reader that trusts it."""
    table = code_table(quant_type)
    if quant_map.dtype != torch.float32 or quant_map.shape != (16,) or not torch.equal(quant_map, table):
        found = quant_map.reshape(-1)[:4].tolist()
        raise CheckpointError(
            f"tensor {tensor!r} is not bitsandbytes' {quant_type} table (it starts {found}, expected "
            f"{table[:4].tolist()}); bitsandbytes ignores the stored table and decodes with its own, so the file is "
            "ambiguous: re-export it"
        )


def restore_absmax(state: QuantState, codes: Tensor, nested_quant_map: Tensor, nested_absmax: Tensor) -> Tensor:
    """The float32 absmax of a double-quantized layer (see the module docstring)."""
    assert state.nested_blocksize is not None and state.nested_offset is not None
    count = codes.numel()
    block = torch.arange(count, device=codes.device) // state.nested_blocksize
    values = nested_quant_map.index_select(0, codes.reshape(-1).to(torch.int64)) * nested_absmax.index_select(0, block)
    return values + torch.tensor(state.nested_offset, dtype=torch.float32)


def unpack_codes(packed: Tensor, elements: int) -> Tensor:
    """uint8 [ceil(elements/2), 1] -> int64 [elements]: high nibble first."""
    flat = packed.reshape(-1)
    pairs = torch.stack((flat >> 4, flat & 15), dim=1)
    return pairs.reshape(-1)[:elements].to(torch.int64)


def dequantize(state: QuantState, packed: Tensor, absmax: Tensor) -> Tensor:
    """The float32 [N, K] weight from the packed codes and the float32 absmax (restored first when
    double-quantized); cast it to ``state.dtype`` for bitsandbytes' own output."""
    n, k = state.shape
    codes = unpack_codes(packed, n * k)
    values = code_table(state.quant_type).index_select(0, codes)
    block = torch.arange(n * k) // state.blocksize
    return (values * absmax.reshape(-1).index_select(0, block)).reshape(n, k)
