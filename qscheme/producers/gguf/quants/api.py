"""The entry point: check the weight, lay its blocks out element-major, run the type's quantizer."""

from __future__ import annotations

import torch
from torch import Tensor

from qscheme.errors import QuantizeError
from qscheme.producers.gguf.quants.table import QUANTIZERS, BlockQuantizer

# Blocks quantized per call of a type's quantizer: large enough that torch's per-op overhead is
# small, small enough that the working set stays in cache (the searches touch each block ~100x).
_BLOCKS_PER_CHUNK_ELEMENTS = 1 << 17


def supported_types() -> tuple[str, ...]:
    """The ggml type names ``quantize_blocks`` reproduces bit for bit, in ggml's order."""
    return tuple(QUANTIZERS)


def quantize_blocks(weights: Tensor, type_name: str, *, tensor_name: str = "weights") -> Tensor:
    """Quantize a float32 ``[rows, K]`` weight to ggml type ``type_name``, as llama.cpp does.

    Returns uint8 ``[rows, K // block_elements * block_bytes]``: each row's blocks in order, the
    bytes llama.cpp's reference quantizer writes for them. ``tensor_name`` names the weight in
    errors. Raises QuantizeError for an unknown type, a weight that is not float32 2-D, a K that is
    not a multiple of the type's block, or a non-finite value.
    """
    quantizer = _quantizer(type_name, tensor_name)
    _check_weights(weights, quantizer, tensor_name)
    rows, columns = weights.shape
    blocks = weights.reshape(-1, quantizer.block_elements)
    chunk = max(1, _BLOCKS_PER_CHUNK_ELEMENTS // quantizer.block_elements)
    parts = [
        quantizer.quantize(blocks[start : start + chunk].T.contiguous()) for start in range(0, blocks.shape[0], chunk)
    ]
    packed = torch.cat(parts, dim=0) if parts else torch.empty(0, quantizer.block_bytes, dtype=torch.uint8)
    return packed.reshape(rows, columns // quantizer.block_elements * quantizer.block_bytes)


def _quantizer(type_name: str, tensor_name: str) -> BlockQuantizer:
    quantizer = QUANTIZERS.get(type_name)
    if quantizer is None:
        raise QuantizeError(
            f"{tensor_name}: ggml type {type_name!r} cannot be quantized here; supported: "
            f"{', '.join(QUANTIZERS)}. Choose one of those (type names are upper case, as ggml writes them)."
        )
    return quantizer


def _check_weights(weights: Tensor, quantizer: BlockQuantizer, tensor_name: str) -> None:
    if not isinstance(weights, Tensor):
        raise QuantizeError(
            f"{tensor_name}: expected a torch.Tensor, got {type(weights).__name__}; pass torch.from_numpy(array)."
        )
    if weights.dtype != torch.float32 or weights.dim() != 2:
        raise QuantizeError(
            f"{tensor_name}: expected a float32 tensor [rows, K], got {weights.dtype} with shape "
            f"{list(weights.shape)}; llama.cpp quantizes float32 rows: pass weights.float().reshape(rows, K)."
        )
    columns = weights.shape[1]
    if columns % quantizer.block_elements:
        raise QuantizeError(
            f"{tensor_name}: {quantizer.name} stores blocks of {quantizer.block_elements} weights along a row, "
            f"but K = {columns} is not a multiple of {quantizer.block_elements}; pad the rows or choose a type "
            f"with a smaller block (Q8_0, Q4_0 and the other 32-weight types)."
        )
    finite = torch.isfinite(weights)
    if not bool(finite.all()):
        row, column = (int(i) for i in torch.nonzero(~finite)[0])
        raise QuantizeError(
            f"{tensor_name}: row {row} holds a non-finite value ({float(weights[row, column])} at column {column}); "
            f"ggml's quantizers need finite weights: fix or drop the non-finite values before quantizing."
        )
