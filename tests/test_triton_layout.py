"""The 4-bit word layouts the Triton GEMM reads (qscheme.triton.layout), checked in Python
integers against the cuts its decoders make."""

from __future__ import annotations

import pytest
import torch

from qscheme.formats import decode
from qscheme.triton.layout import PLACEMENTS, canonical_from_words, four_bit_words

ALL_CODES = torch.tensor([[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]], dtype=torch.uint8)  # codes 0..15


def _codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, bytes] -> the codes in K order, [rows, 2 * bytes]."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def _sample(rows: int, seed: int) -> torch.Tensor:
    packed = torch.randint(0, 256, (rows, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    packed[0] = ALL_CODES[0]
    return packed


@pytest.mark.parametrize("element", sorted(PLACEMENTS))
@pytest.mark.parametrize("nbytes", [1, 3, 4, 8, 13])
def test_words_round_trip_to_the_canonical_bytes(element: str, nbytes: int) -> None:
    packed = torch.randint(0, 256, (5, nbytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    words = four_bit_words(packed, element)
    assert words.dtype == torch.int32 and words.shape == (5, -(-nbytes // 4))
    assert torch.equal(canonical_from_words(words, nbytes, element), packed)


@pytest.mark.parametrize("element", sorted(PLACEMENTS))
def test_a_placement_uses_every_bit_of_a_word_once(element: str) -> None:
    places = [place + 16 * half for pair in PLACEMENTS[element] for place in pair for half in (0, 1)]
    assert sorted(places) == list(range(32))


def _half_value(pattern: int, exponent_bits: int, mantissa_bits: int) -> float:
    """A 16-bit float pattern's value (bfloat16: 8, 7; float16: 5, 10)."""
    sign = -1.0 if pattern >> 15 else 1.0
    bias = (1 << (exponent_bits - 1)) - 1
    exponent, mantissa = (pattern >> mantissa_bits) & ((1 << exponent_bits) - 1), pattern & ((1 << mantissa_bits) - 1)
    if exponent == 0:
        return sign * mantissa / (1 << mantissa_bits) * 2.0 ** (1 - bias)
    return sign * 2.0 ** (exponent - bias) * (1 + mantissa / (1 << mantissa_bits))


def _halves(register: int, exponent_bits: int = 8, mantissa_bits: int = 7) -> list[float]:
    return [
        _half_value(register & 0xFFFF, exponent_bits, mantissa_bits),
        _half_value(register >> 16, exponent_bits, mantissa_bits),
    ]


def test_the_e2m1_cuts_give_each_pair_of_codes_as_bfloat16_patterns() -> None:
    """The four expressions of the module docstring (what decode_e2m1_words computes): pair i of
    every word is codes 2i and 2i+1 at 2**-126 times their values."""
    mask = 0x81C081C0
    packed = _sample(64, 1)
    expected = decode(_codes(packed), "e2m1").reshape(64, -1, 8)
    words = four_bit_words(packed, "e2m1").to(torch.int64) & 0xFFFFFFFF
    for row in range(words.shape[0]):
        for index, word in enumerate(words[row].tolist()):
            pairs = [word & mask, (word << 3) & mask, (word << 6) & mask, (((word >> 7) & 0x00D800D8) * 2081) & mask]
            for pair, bits in enumerate(pairs):
                values = [value * 2.0**126 for value in _halves(bits)]
                assert values == expected[row, index, 2 * pair : 2 * pair + 2].tolist(), (row, index, pair)


@pytest.mark.parametrize("element", ["int4", "uint4"])
@pytest.mark.parametrize(
    ("half", "exponent_bits", "mantissa_bits", "base"), [("bf16", 8, 7, 0x4300), ("fp16", 5, 10, 0x6400)]
)
def test_the_int4_cuts_give_each_pair_of_codes_as_offset_16_bit_floats(
    element: str, half: str, exponent_bits: int, mantissa_bits: int, base: int
) -> None:
    """What decode_int4_words computes: ((word >> 4i) & 0x000F000F) ^ (base | flip) is codes
    2i and 2i+1 as 128 + code (bfloat16) or 1024 + code (float16), plus 8 for int4."""
    flip = 0x00080008 if element == "int4" else 0
    offset = (128.0 if half == "bf16" else 1024.0) + (8.0 if element == "int4" else 0.0)
    packed = _sample(64, 2)
    nibbles = _codes(packed)
    if element == "int4":  # two's complement nibbles
        nibbles = ((nibbles.to(torch.int8) ^ 8) - 8).to(torch.int8)
    expected = decode(nibbles, element).reshape(64, -1, 8)
    words = four_bit_words(packed, element).to(torch.int64) & 0xFFFFFFFF
    for row in range(words.shape[0]):
        for index, word in enumerate(words[row].tolist()):
            for pair in range(4):
                bits = ((word >> (4 * pair)) & 0x000F000F) ^ (base | base << 16 | flip)
                values = [value - offset for value in _halves(bits, exponent_bits, mantissa_bits)]
                assert values == expected[row, index, 2 * pair : 2 * pair + 2].tolist(), (row, index, pair)


def test_padding_codes_are_zero() -> None:
    packed = torch.full((2, 5), 0xFF, dtype=torch.uint8)
    words = four_bit_words(packed, "e2m1")
    codes = _codes(canonical_from_words(words, 8, "e2m1"))
    assert torch.equal(codes[:, 10:], torch.zeros(2, 6, dtype=torch.uint8))
    assert torch.equal(codes[:, :10], torch.full((2, 10), 0xF, dtype=torch.uint8))


def test_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="2-D uint8"):
        four_bit_words(torch.zeros(4, dtype=torch.uint8), "e2m1")
    with pytest.raises(ValueError, match="2-D uint8"):
        four_bit_words(torch.zeros(2, 4, dtype=torch.int8), "int4")
    with pytest.raises(ValueError, match="no word layout for element format 'e4m3'"):
        four_bit_words(torch.zeros(2, 4, dtype=torch.uint8), "e4m3")
