"""Bit packing shared by the GGUF block layouts: codes in element-major order to block bytes.

Every function takes integer codes laid out ``[elements, blocks]`` (int32) and returns uint8
``[blocks, bytes]``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def pack_nibble_halves(codes: Tensor) -> Tensor:
    """Byte j holds element j in its low nibble and element j + n/2 in its high nibble."""
    half = codes.shape[0] // 2
    return ((codes[:half] & 0xF) | ((codes[half:] & 0xF) << 4)).to(torch.uint8).T


def pack_bit_planes(bits: Tensor) -> Tensor:
    """Bit t of byte b is ``bits[8 * b + t]`` (a little-endian bit field over the elements)."""
    grouped = bits.reshape(bits.shape[0] // 8, 8, -1)
    packed = torch.zeros_like(grouped[:, 0])
    for position in range(8):
        packed |= grouped[:, position] << position
    return packed.to(torch.uint8).T


def pack_pairs_of_halves(codes: Tensor, group: int) -> Tensor:
    """Nibble pairs per run of ``group`` elements: byte l of a run holds its elements l and
    l + group/2 (the 4-bit layout of Q4_K, Q5_K and IQ4_XS: 32 bytes per 64 elements)."""
    runs = codes.reshape(codes.shape[0] // group, group, -1)
    half = group // 2
    packed = (runs[:, :half] & 0xF) | ((runs[:, half:] & 0xF) << 4)
    return packed.reshape(-1, codes.shape[1]).to(torch.uint8).T


def pack_crumbs(codes: Tensor) -> Tensor:
    """2-bit codes, 128 elements per 32 bytes: byte l holds elements l, l+32, l+64, l+96 at bits
    0, 2, 4, 6 (Q2_K's and Q3_K's low bits)."""
    runs = codes.reshape(codes.shape[0] // 128, 4, 32, -1) & 3
    packed = runs[:, 0] | (runs[:, 1] << 2) | (runs[:, 2] << 4) | (runs[:, 3] << 6)
    return packed.reshape(-1, codes.shape[1]).to(torch.uint8).T
