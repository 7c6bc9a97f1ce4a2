"""The e2m1 word layout the Triton GEMM reads (qscheme.triton.layout)."""

from __future__ import annotations

import pytest
import torch

from qscheme.formats import decode
from qscheme.triton.layout import E2M1_WORD_BITS, canonical_from_e2m1_words, e2m1_words


def _codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, bytes] -> the codes in K order, [rows, 2 * bytes]."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


@pytest.mark.parametrize("nbytes", [1, 3, 4, 8, 13])
def test_words_round_trip_to_the_canonical_bytes(nbytes: int) -> None:
    packed = torch.randint(0, 256, (5, nbytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    words = e2m1_words(packed)
    assert words.dtype == torch.int32 and words.shape == (5, -(-nbytes // 4))
    assert torch.equal(canonical_from_e2m1_words(words, nbytes), packed)


def test_the_placement_uses_every_bit_of_a_word_once() -> None:
    places = [place + 16 * half for pair in E2M1_WORD_BITS for place in pair for half in (0, 1)]
    assert sorted(places) == list(range(32))


def _bf16_value(pattern: int) -> float:
    """A 16-bit bfloat16 pattern's value."""
    sign = -1.0 if pattern >> 15 else 1.0
    exponent, mantissa = (pattern >> 7) & 0xFF, pattern & 0x7F
    if exponent == 0:
        return sign * mantissa / 128 * 2.0**-126
    return sign * 2.0 ** (exponent - 127) * (1 + mantissa / 128)


def test_the_documented_cuts_give_each_pair_of_codes_as_bfloat16_patterns() -> None:
    """The four expressions of the module docstring (what the Triton decoder computes), in
    Python integers: pair i of every word is codes 2i and 2i+1 at 2**-126 times their values."""
    mask = 0x81C081C0
    packed = torch.randint(0, 256, (64, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    packed[0] = torch.tensor([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE], dtype=torch.uint8)  # all 16 codes
    expected = decode(_codes(packed), "e2m1").reshape(64, -1, 8)
    words = e2m1_words(packed).to(torch.int64) & 0xFFFFFFFF
    for row in range(words.shape[0]):
        for index, word in enumerate(words[row].tolist()):
            pairs = [word & mask, (word << 3) & mask, (word << 6) & mask, (((word >> 7) & 0x00D800D8) * 2081) & mask]
            for pair, bits in enumerate(pairs):
                values = [_bf16_value(bits & 0xFFFF) * 2.0**126, _bf16_value(bits >> 16 & 0xFFFF) * 2.0**126]
                assert values == expected[row, index, 2 * pair : 2 * pair + 2].tolist(), (row, index, pair)


def test_padding_codes_are_zero() -> None:
    packed = torch.full((2, 5), 0xFF, dtype=torch.uint8)
    words = e2m1_words(packed)
    codes = _codes(canonical_from_e2m1_words(words, 8))
    assert torch.equal(codes[:, 10:], torch.zeros(2, 6, dtype=torch.uint8))
    assert torch.equal(codes[:, :10], torch.full((2, 10), 0xF, dtype=torch.uint8))


def test_rejects_anything_but_two_dimensional_uint8() -> None:
    with pytest.raises(ValueError, match="2-D uint8"):
        e2m1_words(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="2-D uint8"):
        e2m1_words(torch.zeros(2, 4, dtype=torch.int8))
