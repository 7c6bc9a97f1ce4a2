"""4-bit weight codes in the order the GEMM reads them (host side, torch only).

Canonical 4-bit codes are two per byte along K, low nibble first. The GEMM reads int32 words
of eight codes and cuts each pair of consecutive codes (2i, 2i+1), the pair the tensor cores
take in one 32-bit register, out of a word as two 16-bit float bit patterns, the even code's in
the low half. So each word is stored with its 32 bits placed where those cuts are cheap. A
placement is data: ``placement[i][b]`` is the word bit holding bit ``b`` of code 2i (b = 0 the
lowest), code 2i+1's bit is 16 higher.

e2m1 (``E2M1_WORD_BITS``): the cut makes bfloat16 patterns worth 2**-126 times the codes'
values (sign at bit 15, exponent bits and mantissa bit at 8, 7, 6), 9 integer operations per
word against 15 for the canonical nibble order:

- pair 0 (codes 0, 1) already in place: ``word & 0x81C081C0``;
- pair 1 (codes 2, 3) three bits lower: ``(word << 3) & 0x81C081C0``;
- pair 2 (codes 4, 5) six bits lower: ``(word << 6) & 0x81C081C0``;
- pair 3 (codes 6, 7) in the 8 bits left over (10, 11, 13, 14 and 16 higher), spread back by
  one multiply whose shifted copies never overlap:
  ``(((word >> 7) & 0x00D800D8) * 2081) & 0x81C081C0`` (2081 = 1 + 2**5 + 2**11).

int4 and uint4 (``INT4_WORD_BITS``): codes 0, 2, 4, 6 in nibbles 0-3 and codes 1, 3, 5, 7 in
nibbles 4-7, so pair i is ``(word >> 4i) & 0x000F000F``; one more logical operation ORs in the
exponent of 128 (bfloat16) or 1024 (float16), making each half 128 + code (1024 + code), and
flips the sign bit of int4 codes to offset binary. A subtraction then gives the integers.
"""

from __future__ import annotations

import torch
from torch import Tensor

Placement = tuple[tuple[int, int, int, int], ...]

E2M1_WORD_BITS: Placement = (
    (6, 7, 8, 15),
    (3, 4, 5, 12),
    (0, 1, 2, 9),
    (13, 14, 10, 11),
)
INT4_WORD_BITS: Placement = (
    (0, 1, 2, 3),
    (4, 5, 6, 7),
    (8, 9, 10, 11),
    (12, 13, 14, 15),
)
PLACEMENTS: dict[str, Placement] = {"e2m1": E2M1_WORD_BITS, "int4": INT4_WORD_BITS, "uint4": INT4_WORD_BITS}


def _codes(packed: Tensor) -> Tensor:
    """uint8 [rows, 4 * words] -> int64 [rows, words, 8] codes in K order."""
    quads = packed.reshape(packed.shape[0], -1, 4).to(torch.int64)
    return torch.stack([quads & 0xF, quads >> 4], dim=-1).reshape(packed.shape[0], -1, 8)


def four_bit_words(packed: Tensor, element: str) -> Tensor:
    """uint8 [rows, bytes] canonical codes of ``element`` -> int32 [rows, ceil(bytes / 4)] words.

    Rows are zero-padded to whole words; the GEMM masks its inputs past K, and zeroes the
    decoded weights there where a tiled zero point makes padding codes decode to non-zero
    values (``gemm.load_weight_tile``'s ``W_MASK_K``), so padding adds nothing.
    """
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"expected a 2-D uint8 tensor of packed codes, got {packed.dtype} {tuple(packed.shape)}")
    if element not in PLACEMENTS:
        raise ValueError(f"no word layout for element format {element!r}; one of {', '.join(PLACEMENTS)}")
    padding = -packed.shape[1] % 4
    if padding:
        packed = torch.nn.functional.pad(packed, (0, padding))
    codes = _codes(packed)
    words = torch.zeros(codes.shape[:2], dtype=torch.int64, device=packed.device)
    for pair, places in enumerate(PLACEMENTS[element]):
        for half in (0, 1):
            code = codes[..., 2 * pair + half]
            for bit, place in enumerate(places):
                words |= ((code >> bit) & 1) << (place + 16 * half)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # as signed 32-bit
    return words.to(torch.int32).contiguous()


def canonical_from_words(words: Tensor, nbytes: int, element: str) -> Tensor:
    """The inverse of ``four_bit_words``: int32 words -> uint8 [rows, nbytes] canonical codes."""
    bits = words.to(torch.int64) & 0xFFFFFFFF
    codes = torch.zeros((*words.shape, 8), dtype=torch.int64, device=words.device)
    for pair, places in enumerate(PLACEMENTS[element]):
        for half in (0, 1):
            for bit, place in enumerate(places):
                codes[..., 2 * pair + half] |= ((bits >> (place + 16 * half)) & 1) << bit
    pairs = codes.reshape(words.shape[0], -1, 2)
    canonical = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return canonical[:, :nbytes].contiguous()
