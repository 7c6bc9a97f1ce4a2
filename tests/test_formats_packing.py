"""Packings: round trips for any shape, and bit-exact layouts against compressed-tensors and
a transcription of ModelOpt's int4 packer."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from qscheme.errors import FormatError
from qscheme.formats import (
    decode,
    pack_fp4_k,
    pack_int4_n,
    pack_int32_k,
    pack_int32_n,
    pack_nibbles_k,
    unpack_fp4_k,
    unpack_int4_n,
    unpack_int32_k,
    unpack_int32_n,
    unpack_nibbles_k,
)

shapes = st.tuples(
    st.integers(min_value=0, max_value=3),  # leading (expert) dims; 0 means none
    st.integers(min_value=1, max_value=9),
    st.integers(min_value=1, max_value=70),
)


def _shape(drawn: tuple[int, int, int]) -> tuple[int, ...]:
    experts, rows, cols = drawn
    return (experts, rows, cols) if experts else (rows, cols)


def _signed(shape: tuple[int, ...], bits: int, seed: int) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    high = 1 << (bits - 1)
    return torch.randint(-high, high, shape, generator=generator, dtype=torch.int8)


# --- layouts, by hand ----------------------------------------------------------------------


def test_fp4_k_puts_even_elements_in_the_low_nibble() -> None:
    codes = torch.tensor([[0x1, 0x2, 0x3, 0x4, 0xF]], dtype=torch.uint8)
    assert pack_fp4_k(codes).tolist() == [[0x21, 0x43, 0x0F]]
    assert unpack_fp4_k(pack_fp4_k(codes), 5).tolist() == codes.tolist()
    assert pack_nibbles_k is pack_fp4_k and unpack_nibbles_k is unpack_fp4_k


def test_int32_k_stores_element_zero_in_the_lowest_bits_offset_by_half() -> None:
    values = torch.tensor([[-8, -7, 0, 7, -8, -8, -8, -8]], dtype=torch.int8)
    # unsigned nibbles 0, 1, 8, 15, 0, 0, 0, 0 from the lowest bits up
    assert pack_int32_k(values, 4).tolist() == [[0x0000F810]]
    top_bit_set = torch.full((1, 8), 7, dtype=torch.int8)
    assert pack_int32_k(top_bit_set, 4).tolist() == [[-1]]  # 0xFFFFFFFF as int32


def test_int32_k_straddles_words_for_odd_widths() -> None:
    values = torch.full((1, 11), 3, dtype=torch.int8)  # 3-bit: unsigned 7 = 0b111
    packed = pack_int32_k(values, 3)
    assert packed.shape == (1, 2)  # 33 bits
    assert packed.tolist() == [[-1, 1]]  # 32 ones, then the last bit in word 1


def test_int4_n_puts_even_rows_in_the_low_nibble() -> None:
    values = torch.tensor([[1, -1], [-8, 7], [3, 0]], dtype=torch.int8)
    assert pack_int4_n(values).tolist() == [[0x81, 0x7F], [0x03, 0x00]]
    assert unpack_int4_n(pack_int4_n(values), 3).tolist() == values.tolist()


# --- round trips ---------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(drawn=shapes, seed=st.integers(0, 2**16))
def test_fp4_k_round_trips(drawn: tuple[int, int, int], seed: int) -> None:
    shape = _shape(drawn)
    codes = torch.randint(0, 16, shape, generator=torch.Generator().manual_seed(seed))
    codes = codes.to(torch.uint8)
    packed = pack_fp4_k(codes)
    assert packed.shape == (*shape[:-1], (shape[-1] + 1) // 2)
    assert torch.equal(unpack_fp4_k(packed, shape[-1]), codes)


@settings(max_examples=60, deadline=None)
@given(drawn=shapes, bits=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_int32_round_trips_along_k_and_n(drawn: tuple[int, int, int], bits: int, seed: int) -> None:
    shape = _shape(drawn)
    values = _signed(shape, bits, seed)
    along_k = pack_int32_k(values, bits)
    assert along_k.shape == (*shape[:-1], -(-shape[-1] * bits // 32))
    assert torch.equal(unpack_int32_k(along_k, bits, shape[-1]), values)
    along_n = pack_int32_n(values, bits)
    assert along_n.shape == (*shape[:-2], -(-shape[-2] * bits // 32), shape[-1])
    assert torch.equal(unpack_int32_n(along_n, bits, shape[-2]), values)


@settings(max_examples=40, deadline=None)
@given(drawn=shapes, seed=st.integers(0, 2**16))
def test_int4_n_round_trips(drawn: tuple[int, int, int], seed: int) -> None:
    shape = _shape(drawn)
    values = _signed(shape, 4, seed)
    packed = pack_int4_n(values)
    assert packed.shape == (*shape[:-2], (shape[-2] + 1) // 2, shape[-1])
    assert torch.equal(unpack_int4_n(packed, shape[-2]), values)


# --- against the producers -------------------------------------------------------------------


@pytest.mark.parametrize("bits", range(1, 9))
# N >= 9: compressed-tensors 0.20's unpack_from_int32(bits=4, packed_dim=0) fails on a single
# packed row (N * 4 <= 32) because it views a non-contiguous transpose as bytes.
@pytest.mark.parametrize("shape", [(13, 64), (37, 45), (33, 3), (2, 19, 17)])
def test_int32_packing_matches_compressed_tensors(bits: int, shape: tuple[int, ...]) -> None:
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    values = _signed(shape, bits, seed=bits)
    for packed_dim, pack, unpack in ((1, pack_int32_k, unpack_int32_k), (0, pack_int32_n, None)):
        reference = helpers.pack_to_int32(values, bits, packed_dim=packed_dim)
        assert torch.equal(pack(values, bits), reference), (bits, packed_dim)
        unpacked = helpers.unpack_from_int32(reference, bits, values.shape, packed_dim=packed_dim)
        if unpack is not None:
            assert torch.equal(unpack(reference, bits, shape[-1]), unpacked)
        else:
            assert torch.equal(unpack_int32_n(reference, bits, shape[-2]), unpacked)


def test_fp4_packing_matches_compressed_tensors() -> None:
    helpers = pytest.importorskip("compressed_tensors.compressors.nvfp4.helpers")
    codes = torch.randint(0, 16, (6, 48), generator=torch.Generator().manual_seed(3))
    codes = codes.to(torch.uint8)
    values = decode(codes, "e2m1")
    # compressed-tensors packs fp4 values; give it -0.0 where the code carries a sign bit.
    values = torch.where(codes == 8, -0.0, values)
    reference = helpers.pack_fp4_to_uint8(values)
    assert torch.equal(pack_fp4_k(codes), reference)
    unpacked = helpers.unpack_fp4_from_uint8(reference, 6, 48, dtype=torch.float32)
    assert torch.equal(decode(unpack_fp4_k(reference, 48), "e2m1"), unpacked)


def _modelopt_pack_int4(int8_tensor: Tensor) -> Tensor:
    """Transcription of ModelOpt's pack_int4_in_uint8 after its round/clamp step."""
    out_dim, in_dim = int8_tensor.shape[-2], int8_tensor.shape[-1]
    if int8_tensor.dim() == 3:
        transpose = int8_tensor.permute(0, 2, 1).reshape(-1, in_dim, out_dim // 2, 2)
        packed = (transpose[..., 0] & 0x0F) | ((transpose[..., 1] & 0x0F) << 4)
        return packed.permute(0, 2, 1).contiguous().view(torch.uint8)
    reshaped = int8_tensor.T.reshape(in_dim, out_dim // 2, 2)
    packed = (reshaped[..., 0] & 0x0F) | ((reshaped[..., 1] & 0x0F) << 4)
    return packed.T.contiguous().view(torch.uint8)


@pytest.mark.parametrize("shape", [(8, 5), (2, 1), (3, 6, 16)])
def test_int4_n_matches_modelopt(shape: tuple[int, ...]) -> None:
    values = _signed(shape, 4, seed=7)
    assert torch.equal(pack_int4_n(values), _modelopt_pack_int4(values))


# --- errors ----------------------------------------------------------------------------------


def test_packing_rejects_values_out_of_range() -> None:
    with pytest.raises(FormatError, match=r"\[-4, 3\], found values in \[-8, 7\]"):
        pack_int32_k(torch.tensor([[-8, 7]], dtype=torch.int8), 3)
    with pytest.raises(FormatError, match=r"must lie in \[0, 15\]"):
        pack_fp4_k(torch.tensor([16], dtype=torch.uint8))
    with pytest.raises(FormatError, match=r"must lie in \[-8, 7\]"):
        pack_int4_n(torch.tensor([[8], [0]], dtype=torch.int8))


def test_packing_rejects_wrong_dtypes_widths_and_lengths() -> None:
    with pytest.raises(FormatError, match=r"must be torch\.uint8, got torch\.int32"):
        pack_fp4_k(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(FormatError, match="integer dtype"):
        pack_int32_k(torch.zeros(1, 8), 4)
    with pytest.raises(FormatError, match="1 to 8 bits"):
        pack_int32_k(torch.zeros(1, 8, dtype=torch.int8), 9)
    with pytest.raises(FormatError, match="expected 2 along dim -1, got 3"):
        unpack_int32_k(torch.zeros(1, 3, dtype=torch.int32), 4, 16)
    with pytest.raises(FormatError, match="expected 2 along dim -1, got 1"):
        unpack_fp4_k(torch.zeros(1, 1, dtype=torch.uint8), 4)
    with pytest.raises(FormatError, match="expected 2 along dim -2, got 3"):
        unpack_int4_n(torch.zeros(3, 4, dtype=torch.uint8), 4)
    with pytest.raises(FormatError, match="at least 2 dims"):
        pack_int32_n(torch.zeros(8, dtype=torch.int8), 4)
