"""The canonical weight of a scheme of packed blocks (``packing: blocks``).

A block weight stays as it is stored: ``codes`` holds the raw blocks, uint8 [N, K / elements *
bytes], the one copy of the layer's data; ``scale`` is empty (the scales live inside the
blocks). Dequantization decodes the blocks as the descriptor declares them
(``qscheme.formats.blocks``, reached through ``qscheme.canonical_weight.dequantize_rows``).

What decoding cannot survive is refused here, naming the layer, the block and the field: a float
field that is not finite (a NaN or infinite fp16 scale), and an e8m0 exponent byte of 255 (NaN in
the OCP formats). With finite fields, every weight the declaration computes is finite.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qscheme.canonical_weight import CanonicalWeight
from qscheme.descriptor import Scheme
from qscheme.descriptor.blocks import BlockField
from qscheme.errors import QuantizeError
from qscheme.formats.blocks import float_field_values, native_decoder
from qscheme.slabs import row_slabs, run_slabs

# Where a float format keeps its exponent: (byte of the value, little-endian, mask) pairs whose bits
# are all set exactly when the value is infinite or NaN.
_EXPONENT_BYTES: dict[str, tuple[tuple[int, int], ...]] = {
    "fp16": ((1, 0x7C),),
    "bf16": ((1, 0x7F), (0, 0x80)),
    "fp32": ((3, 0x7F), (2, 0x80)),
}


SCAN_SLAB_BYTES = 8 << 20  # blocks scanned per worker call


def _first_masked(field: BlockField, blocks: Tensor, masks: tuple[tuple[int, int], ...]) -> int | None:
    """The first block holding a value of ``field`` whose bytes have every ``(byte, mask)`` bit set
    (one pass over a byte or two per value, instead of decoding every value), or None."""
    size = field.size // field.count
    native = native_decoder()
    if native is not None and blocks.is_cpu and blocks.is_contiguous() and len(masks) <= 2:
        (byte0, mask0), (byte1, mask1) = (*masks, (0, 0))[:2]
        found: list[int] = []

        def scan(part: slice) -> None:  # on qscheme's worker threads: the C loop releases the GIL
            at = native.first_masked(
                blocks[part].data_ptr(), part.stop - part.start, blocks.shape[1], field.offset, size, field.count,
                byte0, mask0, byte1, mask1,
            )  # fmt: skip
            if at >= 0:
                found.append(part.start + int(at))

        run_slabs(scan, row_slabs(blocks.shape[0], blocks.shape[1], target=SCAN_SLAB_BYTES), blocks.device)
        return min(found) if found else None
    hit: Tensor | None = None
    for byte, mask in masks:
        columns = blocks[:, field.offset + byte : field.offset + field.size : size]
        at = (columns & mask) == mask
        hit = at if hit is None else hit & at
    assert hit is not None
    rows = hit.any(dim=1)
    return int(rows.nonzero()[0, 0]) if bool(rows.any()) else None


def _bad_field(field: BlockField, blocks: Tensor) -> tuple[int, float] | None:
    """The first block whose ``field`` holds a value that cannot be decoded, and that value."""
    if field.format == "e8m0":
        index = _first_masked(field, blocks, ((0, 0xFF),))
        return None if index is None else (index, float("nan"))
    if field.format not in _EXPONENT_BYTES:
        return None  # e4m3 and ue4m3 fields are decoded through finite tables (e4m3's NaN aside)
    index = _first_masked(field, blocks, _EXPONENT_BYTES[str(field.format)])
    if index is None:
        return None
    values = float_field_values(blocks[index : index + 1], field)[0]
    return index, float(values[~torch.isfinite(values)][0])


def require_decodable(scheme: Scheme, raw: Tensor, layer: str | None) -> None:
    """QuantizeError naming the first block (row and block within it) with a field that does not decode."""
    layout = scheme.weight.blocks
    assert layout is not None
    per_row = raw.shape[1] // layout.bytes
    blocks = raw.reshape(-1, layout.bytes)
    for field in layout.fields:
        if field.format is None:
            continue
        found = _bad_field(field, blocks)
        if found is None:
            continue
        index, value = found
        row, block = divmod(index, per_row) if per_row else (0, 0)
        where = f"layer {layer}: " if layer else ""
        allowed = "an exponent byte of 0 to 254" if field.format == "e8m0" else f"a finite {field.format}"
        raise QuantizeError(
            f"{where}scheme {scheme.name}: tensor {scheme.weight.tensor.name!r} row {row} block {block}: field "
            f"{field.name!r} is {value} (allowed: {allowed}); the file is corrupt: re-download or re-convert it"
        )


def canonical_blocks(
    scheme: Scheme, stored: Tensor, n: int, k: int, *, layer: str | None = None, check_finite: bool = True
) -> CanonicalWeight:
    """The canonical weight of packed blocks: the raw bytes as codes (see the module docstring)."""
    layout = scheme.weight.blocks
    assert layout is not None
    expected = (n, k // layout.elements * layout.bytes)
    if stored.dtype != torch.uint8 or k % layout.elements or tuple(stored.shape) != expected:
        raise QuantizeError(
            f"scheme {scheme.name}: tensor {scheme.weight.tensor.name!r} must be uint8 {list(expected)} "
            f"(K={k} in blocks of {layout.elements}, {layout.bytes} bytes each), found {stored.dtype} "
            f"{list(stored.shape)}"
        )
    codes = stored.contiguous()
    if check_finite:
        require_decodable(scheme, codes, layer)
    empty = torch.empty((n, 0), dtype=torch.float32, device=codes.device)
    return CanonicalWeight(scheme=scheme, n=n, k=k, codes=codes, scale=empty, partitions=(n,))
