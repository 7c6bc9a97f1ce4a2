"""Bit packings of sub-byte integers and codes, as the checkpoint producers write them.

A weight is [N, K] (N output features, K input features); leading batch dimensions (MoE
experts) are allowed everywhere and packed independently.

- `pack_fp4_k`: two 4-bit codes per uint8 along K, element 2j in the low nibble
  (NVFP4 and MXFP4 of compressed-tensors and ModelOpt).
- `pack_int32_k` / `pack_int32_n`: compressed-tensors `pack-quantized`, a dense bit stream of
  `bits`-wide unsigned values (signed value + 2**(bits-1)) in int32 words, element 0 in the
  lowest bits, values straddling words for odd widths; along K for weights, along N for
  zero points.
  A pack order (AWQ: 0, 2, 4, 6, 1, 3, 5, 7) permutes the values of each word: slot i (bits
  i*bits upward) holds element order[i] of the word's run.
- `pack_int4_n`: ModelOpt INT4 AWQ, two output rows per uint8, row 2i in the low nibble,
  two's-complement nibbles.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.nn import functional

from qscheme.errors import FormatError

_WORD_BITS = 32


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_uint8(tensor: Tensor, what: str) -> None:
    if tensor.dtype != torch.uint8:
        raise FormatError(f"{what} must be torch.uint8, got {tensor.dtype}")


def _check_integer(tensor: Tensor, what: str) -> None:
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise FormatError(f"{what} must have an integer dtype, got {tensor.dtype}")


def _check_range(values: Tensor, low: int, high: int, what: str) -> None:
    if values.numel() == 0:
        return
    found_low, found_high = int(values.min()), int(values.max())
    if found_low < low or found_high > high:
        raise FormatError(
            f"{what} must lie in [{low}, {high}], found values in [{found_low}, {found_high}]; "
            f"round and clamp them to the format first"
        )


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise FormatError(f"int32 packing supports 1 to 8 bits per value, got bits={bits}")


def _check_length(packed: Tensor, dim: int, expected: int, what: str) -> None:
    if packed.ndim == 0 or packed.shape[dim] != expected:
        size = packed.shape[dim] if packed.ndim else "a 0-dim tensor"
        raise FormatError(f"{what}: expected {expected} along dim {dim}, got {size}")


# --- two 4-bit codes per byte along K ----------------------------------------------------


def pack_fp4_k(codes: Tensor) -> Tensor:
    """Pack 4-bit codes (uint8, 0..15) two per byte along the last dim.

    Element 2j goes to the low nibble and 2j+1 to the high nibble; an odd last element is
    paired with a zero high nibble. [..., K] -> [..., ceil(K/2)] uint8.
    """
    _check_uint8(codes, "4-bit codes")
    if codes.ndim == 0:
        raise FormatError("4-bit codes must have at least one dimension, got a 0-dim tensor")
    _check_range(codes, 0, 15, "4-bit codes")
    if codes.shape[-1] % 2:
        codes = functional.pad(codes, (0, 1))
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4_k(packed: Tensor, k: int) -> Tensor:
    """Inverse of `pack_fp4_k`: [..., ceil(k/2)] uint8 -> [..., k] uint8 codes 0..15."""
    _check_uint8(packed, "packed 4-bit codes")
    _check_length(packed, -1, _ceil_div(k, 2), f"packed 4-bit codes for k={k}")
    nibbles = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
    return nibbles.flatten(-2)[..., :k]


pack_nibbles_k = pack_fp4_k
"""Alias of `pack_fp4_k` for 4-bit codes that are not fp4 (uint4 values)."""

unpack_nibbles_k = unpack_fp4_k
"""Alias of `unpack_fp4_k`."""


# --- compressed-tensors pack-quantized: dense bit stream in int32 ------------------------


def _lane_layout(bits: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Word index and bit offset of each of the 32 values that fill `bits` words exactly."""
    bit_starts = torch.arange(_WORD_BITS, device=device, dtype=torch.int64) * bits
    return bit_starts // _WORD_BITS, bit_starts % _WORD_BITS


def _pack_last_dim(unsigned: Tensor, bits: int) -> Tensor:
    """Pack unsigned `bits`-wide int64 values along the last dim into int32 words."""
    length = unsigned.shape[-1]
    padded = functional.pad(unsigned, (0, _ceil_div(length, _WORD_BITS) * _WORD_BITS - length))
    groups = padded.unflatten(-1, (-1, _WORD_BITS))  # [..., G, 32 values] -> [..., G, bits words]
    word_index, bit_offset = _lane_layout(bits, unsigned.device)
    words = torch.zeros((*groups.shape[:-1], bits), dtype=torch.int64, device=unsigned.device)
    # Bits of different values never overlap, so adding is OR-ing.
    words.index_add_(-1, word_index, groups << bit_offset)
    straddles = bit_offset + bits > _WORD_BITS
    if bool(straddles.any()):
        carried = groups[..., straddles] >> (_WORD_BITS - bit_offset[straddles])
        words.index_add_(-1, word_index[straddles] + 1, carried)
    words = (words & 0xFFFFFFFF).flatten(-2)[..., : _ceil_div(length * bits, _WORD_BITS)]
    # Reinterpret the low 32 bits as a signed int32.
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _unpack_last_dim(words: Tensor, bits: int, length: int) -> Tensor:
    """Inverse of `_pack_last_dim`: int32 words -> `length` unsigned int64 values."""
    unsigned_words = words.to(torch.int64) & 0xFFFFFFFF
    count = words.shape[-1]
    padded = functional.pad(unsigned_words, (0, _ceil_div(count, bits) * bits - count))
    groups = padded.unflatten(-1, (-1, bits))  # [..., G, bits words]
    word_index, bit_offset = _lane_layout(bits, words.device)
    low = groups[..., word_index] >> bit_offset
    next_word = torch.clamp(word_index + 1, max=bits - 1)
    high = torch.where(bit_offset + bits > _WORD_BITS, groups[..., next_word] << (_WORD_BITS - bit_offset), 0)
    values = (low | high) & ((1 << bits) - 1)
    return values.flatten(-2)[..., :length]


def _check_order(order: Sequence[int], bits: int) -> list[int]:
    per_word = _WORD_BITS // bits
    if _WORD_BITS % bits or sorted(order) != list(range(per_word)):
        raise FormatError(
            f"a pack order for {bits}-bit values lists each of 0..{per_word - 1} once (one int32 word), "
            f"got {list(order)}"
        )
    return list(order)


def elements_from_slots(slots: Tensor, order: Sequence[int], bits: int) -> Tensor:
    """Values read slot by slot (last dim, whole words) -> the elements they hold in order: slot i
    of each word holds element ``order[i]`` of that word's run."""
    order = _check_order(order, bits)
    inverse = [0] * len(order)
    for slot, element in enumerate(order):
        inverse[element] = slot
    index = torch.tensor(inverse, device=slots.device)
    return slots.unflatten(-1, (-1, len(order))).index_select(-1, index).flatten(-2)


def slots_from_elements(elements: Tensor, order: Sequence[int], bits: int) -> Tensor:
    """The inverse of `elements_from_slots`: elements (last dim, padded with zeros to whole words)
    in the order the words' slots hold them."""
    order = _check_order(order, bits)
    length = elements.shape[-1]
    padded = functional.pad(elements, (0, _ceil_div(length, len(order)) * len(order) - length))
    index = torch.tensor(order, device=elements.device)
    return padded.unflatten(-1, (-1, len(order))).index_select(-1, index).flatten(-2)


def pack_int32_k(values: Tensor, bits: int, order: Sequence[int] | None = None) -> Tensor:
    """Pack signed `bits`-wide integers along the last dim into int32 (compressed-tensors).

    `values` lie in [-2**(bits-1), 2**(bits-1) - 1] and are stored offset by +2**(bits-1)
    as a dense little-endian bit stream: [..., K] -> [..., ceil(K*bits/32)] int32. Matches
    compressed-tensors' pack_to_int32(values, bits, packed_dim=1).
    """
    _check_bits(bits)
    _check_integer(values, "values to pack")
    if values.ndim == 0:
        raise FormatError("values to pack must have at least one dimension, got a 0-dim tensor")
    offset = 1 << (bits - 1)
    _check_range(values, -offset, offset - 1, f"signed {bits}-bit values")
    unsigned = values.to(torch.int64) + offset
    if order is not None:
        length = values.shape[-1]
        words = _ceil_div(length * bits, _WORD_BITS)
        return _pack_last_dim(slots_from_elements(unsigned, order, bits), bits)[..., :words]
    return _pack_last_dim(unsigned, bits)


def unpack_int32_k(packed: Tensor, bits: int, k: int, order: Sequence[int] | None = None) -> Tensor:
    """Inverse of `pack_int32_k`: [..., ceil(k*bits/32)] int32 -> [..., k] signed int8."""
    _check_bits(bits)
    if packed.dtype != torch.int32:
        raise FormatError(f"packed values must be torch.int32, got {packed.dtype}")
    expected = _ceil_div(k * bits, _WORD_BITS)
    _check_length(packed, -1, expected, f"int32-packed {bits}-bit values for k={k}")
    if order is not None:
        slots = _unpack_last_dim(packed, bits, expected * _WORD_BITS // bits)
        return (elements_from_slots(slots, order, bits)[..., :k] - (1 << (bits - 1))).to(torch.int8)
    return (_unpack_last_dim(packed, bits, k) - (1 << (bits - 1))).to(torch.int8)


def pack_int32_n(values: Tensor, bits: int, order: Sequence[int] | None = None) -> Tensor:
    """`pack_int32_k` along dim -2 (compressed-tensors zero points, packed_dim=0).

    [..., N, G] -> [..., ceil(N*bits/32), G] int32.
    """
    if values.ndim < 2:
        raise FormatError(f"packing along N needs at least 2 dims, got shape {tuple(values.shape)}")
    return pack_int32_k(values.transpose(-1, -2), bits, order).transpose(-1, -2).contiguous()


def unpack_int32_n(packed: Tensor, bits: int, n: int, order: Sequence[int] | None = None) -> Tensor:
    """Inverse of `pack_int32_n`: [..., ceil(n*bits/32), G] int32 -> [..., n, G] int8."""
    if packed.ndim < 2:
        raise FormatError(f"unpacking along N needs at least 2 dims, got shape {tuple(packed.shape)}")
    return unpack_int32_k(packed.transpose(-1, -2), bits, n, order).transpose(-1, -2).contiguous()


# --- ModelOpt int4: two rows per byte along N ---------------------------------------------


def pack_int4_n(values: Tensor) -> Tensor:
    """Pack signed int4 values (in [-8, 7]) two output rows per byte (ModelOpt INT4 AWQ).

    Row 2i goes to the low nibble and row 2i+1 to the high nibble, each as a two's-complement
    nibble; an odd last row is paired with a zero high nibble. [..., N, K] -> [..., ceil(N/2), K].
    """
    _check_integer(values, "int4 values")
    if values.ndim < 2:
        raise FormatError(f"packing along N needs at least 2 dims, got shape {tuple(values.shape)}")
    _check_range(values, -8, 7, "int4 values")
    nibbles = (values.to(torch.int16) & 0x0F).to(torch.uint8)
    if nibbles.shape[-2] % 2:
        nibbles = functional.pad(nibbles, (0, 0, 0, 1))
    return nibbles[..., 0::2, :] | (nibbles[..., 1::2, :] << 4)


def unpack_int4_n(packed: Tensor, n: int) -> Tensor:
    """Inverse of `pack_int4_n`: [..., ceil(n/2), K] uint8 -> [..., n, K] int8 in [-8, 7]."""
    _check_uint8(packed, "packed int4 values")
    if packed.ndim < 2:
        raise FormatError(f"unpacking along N needs at least 2 dims, got shape {tuple(packed.shape)}")
    _check_length(packed, -2, _ceil_div(n, 2), f"packed int4 rows for n={n}")
    nibbles = torch.stack((packed & 0x0F, packed >> 4), dim=-2)  # [..., N/2, 2, K]
    signed = (nibbles.to(torch.int8) ^ 0x08) - 0x08  # sign-extend a nibble
    return signed.flatten(-3, -2)[..., :n, :]
