"""bitsandbytes' 4-bit quantization arithmetic for ``quantize_weight`` on ``bitsandbytes/*`` schemes:
whole layers at once (``qscheme.quantize.blocks.register_layer_quantizer``), every tensor the scheme
declares from its declaration.

- Each block of ``group_size`` consecutive weights (row-major, flat) is scaled by its absmax, the
  largest magnitude in float32, and each weight takes the code of the table value nearest to
  ``weight / absmax`` (a block of zeros: absmax 0 and the code of 0.0); codes are packed two per
  byte in the scheme's nibble order.
- With double quantization (``weight.scale.quantized``) the absmax are centred on their mean (the
  state's offset) and each block of ``group_size`` of them is scaled by its largest magnitude and
  coded as the nearest value of a 256-value table in [-1, 1]. qscheme writes its own table (evenly
  spaced values): the file stores it (``weight.nested_quant_map``), and every reader, bitsandbytes
  included, decodes with the stored one.
- The JSON state holds the layer's [N, K], the first value the scheme allows for each of its keys
  (the weight's own dtype where the scheme allows it) and the offset.

This writes what bitsandbytes' layout holds; qscheme reads bitsandbytes checkpoints but its
``quantize`` and ``convert`` commands write no ``quant_method: bitsandbytes`` config.
"""

from __future__ import annotations

import json

import torch
from torch import Tensor

from qscheme.descriptor import Scheme
from qscheme.errors import QuantizeError
from qscheme.producers.bitsandbytes.rule import NAME
from qscheme.quantize.blocks import register_layer_quantizer

NESTED_TABLE_SIZE = 256


def nearest_codes(values: Tensor, table: Tensor) -> Tensor:
    """int64 index of the table value nearest to each value (the lower value on a tie)."""
    ordered, order = torch.sort(table)
    midpoints = (ordered[1:] + ordered[:-1]) / 2
    return order.index_select(0, torch.bucketize(values, midpoints, right=True).reshape(-1)).reshape(values.shape)


def _block_codes(flat: Tensor, table: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """(codes [len], absmax [ceil(len / block)]) of a flat float32 vector in blocks of ``block``."""
    count = flat.numel()
    padded = torch.nn.functional.pad(flat, (0, -count % block)).reshape(-1, block)
    absmax = padded.abs().amax(dim=1)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    codes = nearest_codes((padded / safe.unsqueeze(1)).reshape(-1), table)[:count]
    return codes, absmax


def _quantize(scheme: Scheme, weight: Tensor) -> dict[str, Tensor]:
    spec = scheme.weight
    if spec.table is None or spec.packing != "nibbles_k" or spec.state is None or spec.scale.group_size is None:
        raise QuantizeError(
            f"scheme {scheme.name}: the bitsandbytes rules quantize 4-bit codebook weights (table, nibbles_k, a "
            "group size and a JSON state); use another rule set for this scheme"
        )
    n, k = weight.shape
    group = spec.scale.group_size
    if k % group:
        raise QuantizeError(
            f"scheme {scheme.name}: K={k} is not a multiple of the block size {group}: bitsandbytes' blocks would "
            "straddle rows; quantize a layer whose K is a multiple of it"
        )
    source = weight.to(torch.float32)
    if not bool(torch.isfinite(source).all()):
        raise QuantizeError(f"scheme {scheme.name}: the weight holds NaN or infinite values; quantize a finite weight")
    table = torch.tensor(spec.table, dtype=torch.float32, device=weight.device)
    codes, absmax = _block_codes(source.reshape(-1), table, group)
    pairs = codes.to(torch.uint8).reshape(-1, 2)
    first, second = (pairs[:, 1], pairs[:, 0]) if spec.pack_order == (1, 0) else (pairs[:, 0], pairs[:, 1])
    packed = (second << 4) | first  # the low nibble holds ``first``
    out: dict[str, Tensor] = {spec.tensor.name: packed.reshape(-1, 1) if spec.tensor.flat else packed.reshape(n, -1)}
    state = spec.state
    numbers: dict[str, float] = {}
    quantized = spec.scale.quantized
    if quantized is None:
        out[spec.scale.tensor.name] = absmax
    else:
        offset = absmax.mean()
        nested_table = torch.linspace(-1.0, 1.0, NESTED_TABLE_SIZE - 1, device=weight.device)
        nested_table = torch.cat([nested_table, nested_table[-1:]])
        nested_codes, nested_absmax = _block_codes(absmax - offset, nested_table, quantized.group_size)
        out[spec.scale.tensor.name] = nested_codes.to(torch.uint8)
        out[quantized.table.name] = nested_table
        out[quantized.scale.name] = nested_absmax
        if quantized.offset is not None:
            numbers[quantized.offset] = float(offset)
    if spec.table_tensor is not None:
        out[spec.table_tensor.name] = table.clone()
    dtype = str(weight.dtype).removeprefix("torch.")
    items: dict[str, object] = {}
    for key, allowed in state.values.items():
        items[key] = dtype if key == "dtype" and dtype in allowed else allowed[0]
    items[state.shape] = [n, k]
    items.update(numbers)
    missing = [key for key in state.numbers if key not in items]
    if missing:
        raise QuantizeError(f"scheme {scheme.name}: the state key {missing[0]!r} is no number these rules compute")
    out[state.tensor.name] = torch.tensor(list(json.dumps(items).encode()), dtype=torch.uint8, device=weight.device)
    return out


register_layer_quantizer(NAME, _quantize)
