"""Weight codes in the order the GEMM reads them (host side, torch only).

Canonical 4-bit codes are two per byte along K, low nibble first. The e2m1 decoder reads int32
words of eight codes and makes each pair of consecutive codes (2i, 2i+1), the pair the tensor
cores take in one 32-bit register, into two bfloat16 bit patterns worth 2**-126 times the
codes' values: sign at bit 15, the exponent bits and the mantissa bit at 8, 7, 6 (and 16 higher
for the odd code). So each word is stored with its 32 bits placed where those patterns can be
cut out cheaply (9 integer operations per word, against 15 for the canonical nibble order):

- pair 0 (codes 0, 1) already in place: ``word & 0x81C081C0``;
- pair 1 (codes 2, 3) three bits lower: ``(word << 3) & 0x81C081C0``;
- pair 2 (codes 4, 5) six bits lower: ``(word << 6) & 0x81C081C0``;
- pair 3 (codes 6, 7) in the 8 bits left over (10, 11, 13, 14 and 16 higher), spread back by
  one multiply whose shifted copies never overlap:
  ``(((word >> 7) & 0x00D800D8) * 2081) & 0x81C081C0`` (2081 = 1 + 2**5 + 2**11).

``E2M1_WORD_BITS`` is that placement as data; ``e2m1_words`` applies it and
``canonical_from_e2m1_words`` undoes it.
"""

from __future__ import annotations

import torch
from torch import Tensor

# E2M1_WORD_BITS[pair][bit] = the word bit holding ``bit`` (0 mantissa, 1 and 2 exponent, 3
# sign) of the pair's even code; the odd code's is 16 higher.
E2M1_WORD_BITS: tuple[tuple[int, int, int, int], ...] = (
    (6, 7, 8, 15),
    (3, 4, 5, 12),
    (0, 1, 2, 9),
    (13, 14, 10, 11),
)


def _codes(packed: Tensor) -> Tensor:
    """uint8 [rows, 4 * words] -> int64 [rows, words, 8] codes in K order."""
    quads = packed.reshape(packed.shape[0], -1, 4).to(torch.int64)
    return torch.stack([quads & 0xF, quads >> 4], dim=-1).reshape(packed.shape[0], -1, 8)


def e2m1_words(packed: Tensor) -> Tensor:
    """uint8 [rows, bytes] canonical codes -> int32 [rows, ceil(bytes / 4)] words.

    Rows are zero-padded to whole words (code 0 is +0.0).
    """
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"expected a 2-D uint8 tensor of packed codes, got {packed.dtype} {tuple(packed.shape)}")
    padding = -packed.shape[1] % 4
    if padding:
        packed = torch.nn.functional.pad(packed, (0, padding))
    codes = _codes(packed)
    words = torch.zeros(codes.shape[:2], dtype=torch.int64, device=packed.device)
    for pair, places in enumerate(E2M1_WORD_BITS):
        for half in (0, 1):
            code = codes[..., 2 * pair + half]
            for bit, place in enumerate(places):
                words |= ((code >> bit) & 1) << (place + 16 * half)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # as signed 32-bit
    return words.to(torch.int32).contiguous()


def canonical_from_e2m1_words(words: Tensor, nbytes: int) -> Tensor:
    """The inverse of ``e2m1_words``: int32 words -> uint8 [rows, nbytes] canonical codes."""
    bits = words.to(torch.int64) & 0xFFFFFFFF
    codes = torch.zeros((*words.shape, 8), dtype=torch.int64, device=words.device)
    for pair, places in enumerate(E2M1_WORD_BITS):
        for half in (0, 1):
            for bit, place in enumerate(places):
                codes[..., 2 * pair + half] |= ((bits >> (place + 16 * half)) & 1) << bit
    pairs = codes.reshape(words.shape[0], -1, 2)
    canonical = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return canonical[:, :nbytes].contiguous()
