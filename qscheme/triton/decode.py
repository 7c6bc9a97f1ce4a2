"""Element and scale decoders as ``@triton.jit`` functions: integer codes in, float32 out.

Every decoder works from integer bits with integer operations and a bitcast, so it needs no
fp8 hardware type (compute capability 8.0 has none) and is exact on every target and in the
interpreter. The format ids are the constants of ``qscheme.triton.spec``; they are repeated
here as constexprs because a jitted function can only read module-level ``tl.constexpr``s.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Element formats (keep equal to qscheme.triton.spec.ELEMENT_IDS).
E2M1: tl.constexpr = tl.constexpr(0)
INT4: tl.constexpr = tl.constexpr(1)
UINT4: tl.constexpr = tl.constexpr(2)
E4M3: tl.constexpr = tl.constexpr(3)
E5M2: tl.constexpr = tl.constexpr(4)
INT8: tl.constexpr = tl.constexpr(5)
UINT8: tl.constexpr = tl.constexpr(6)
CODEBOOK: tl.constexpr = tl.constexpr(7)  # 4-bit codes indexing a table (qscheme.triton.spec.CODEBOOK_ID)

# Scale formats (keep equal to qscheme.triton.spec.SCALE_FORMAT_IDS).
SCALE_FLOAT: tl.constexpr = tl.constexpr(0)
SCALE_E4M3: tl.constexpr = tl.constexpr(1)
SCALE_E8M0: tl.constexpr = tl.constexpr(2)

_F32_NAN_BITS: tl.constexpr = tl.constexpr(0x7FC00000)
# The e2m1 word layout of qscheme.triton.layout: each pair of codes is cut out as two bfloat16
# bit patterns (sign at bit 15 / 31, exponent and mantissa bits at 6-8 / 22-24), worth 2**-126
# times the codes' values (code 1, 0.5, becomes a bf16 subnormal).
_E2M1_PAIR_BITS: tl.constexpr = tl.constexpr(0x81C081C0 - (1 << 32))
_E2M1_SPREAD_BITS: tl.constexpr = tl.constexpr(0x00D800D8)
_E2M1_SPREAD: tl.constexpr = tl.constexpr(1 + (1 << 5) + (1 << 11))
_TWO_POW_126: tl.constexpr = tl.constexpr(2.0**126)
# The same codes as float16 patterns (sign at bit 15 / 31, exponent and mantissa bits at 11-9 /
# 27-25), worth 2**-14 times the values (code 1 a float16 subnormal).
_PAIR_SIGNS: tl.constexpr = tl.constexpr(0x80008000 - (1 << 32))
_FP16_E2M1_BITS: tl.constexpr = tl.constexpr(0x0E000E00)
_TWO_POW_14: tl.constexpr = tl.constexpr(2.0**14)
# int4 / uint4 words (qscheme.triton.layout.INT4_WORD_BITS): a pair of codes at bits 0-3 and
# 16-19, ORed with the exponent of 128 (bfloat16) or 1024 (float16), whose lowest mantissa
# bits then hold the code; int4's sign bit is flipped (offset binary) by the same operation.
_INT4_PAIR: tl.constexpr = tl.constexpr(0x000F000F)
_BF16_128: tl.constexpr = tl.constexpr(0x43004300)
_FP16_1024: tl.constexpr = tl.constexpr(0x64006400)
_INT4_FLIP: tl.constexpr = tl.constexpr(0x00080008)
# decode dtypes (keep equal to qscheme.triton.spec.DECODE_IDS)
DECODE_FP32: tl.constexpr = tl.constexpr(0)
DECODE_FP16: tl.constexpr = tl.constexpr(1)
DECODE_BF16: tl.constexpr = tl.constexpr(2)
_HIGH_HALF: tl.constexpr = tl.constexpr(0xFFFF0000 - (1 << 32))
# Nibble i holds twice the e2m1 magnitude of code i: 0xC8643210 as a signed int32 (the shifts
# are masked, so the sign extension does not matter).
_E2M1_TWICE_TABLE: tl.constexpr = tl.constexpr(0xC8643210 - (1 << 32))


@triton.jit
def decode_e2m1(codes):
    """e2m1 nibbles (0..15, any integer dtype) -> float32; 0x8 (negative zero) gives +0.0."""
    bits = codes.to(tl.int32)
    # Twice the eight magnitudes [0, 0.5, 1, 1.5, 2, 3, 4, 6] are 4-bit integers: a table in one int32.
    twice = (_E2M1_TWICE_TABLE >> ((bits & 0x7) << 2)) & 0xF
    twice = tl.where((bits & 0x8) != 0, -twice, twice)  # an integer has no negative zero
    return twice.to(tl.float32) * 0.5


@triton.jit
def _split_pair(pair, DTYPE: tl.constexpr, USE_PTX: tl.constexpr):
    """A 32-bit register of two 16-bit float patterns -> its low and high halves.

    ``DTYPE`` (a decode id) bfloat16 or float16: the halves as that type, split by a register
    move under ``USE_PTX``; float32: bfloat16 patterns read as the upper half of a float32 (a
    bfloat16 is a truncated float32).
    """
    if DTYPE == DECODE_FP32:
        low = (pair << 16).to(tl.float32, bitcast=True)
        high = (pair & _HIGH_HALF).to(tl.float32, bitcast=True)
    elif USE_PTX and DTYPE == DECODE_BF16:
        low, high = tl.inline_asm_elementwise(
            "mov.b32 {$0, $1}, $2;", "=h,=h,r", [pair], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1
        )
    elif USE_PTX:
        low, high = tl.inline_asm_elementwise(
            "mov.b32 {$0, $1}, $2;", "=h,=h,r", [pair], dtype=(tl.float16, tl.float16), is_pure=True, pack=1
        )
    elif DTYPE == DECODE_BF16:
        low = pair.to(tl.int16).to(tl.bfloat16, bitcast=True)
        high = (pair >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        low = pair.to(tl.int16).to(tl.float16, bitcast=True)
        high = (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return low, high


@triton.jit
def _join_pairs(e0, e1, e2, e3, e4, e5, e6, e7, ROWS: tl.constexpr, WORDS: tl.constexpr):
    """Eight [ROWS, WORDS] tensors (code j of each word) -> [ROWS, 8*WORDS] in code order.

    tl.join appends an axis: [.., a, b, c] holds code 4a + 2b + c, so the last join puts the two
    halves of each pair (codes 2i and 2i + 1, one register) next to each other.
    """
    even = tl.join(tl.join(e0, e4), tl.join(e2, e6))
    odd = tl.join(tl.join(e1, e5), tl.join(e3, e7))
    return tl.reshape(tl.join(even, odd), (ROWS, WORDS * 8))


@triton.jit
def decode_int4_words(
    words,
    ROWS: tl.constexpr,
    WORDS: tl.constexpr,
    SIGNED: tl.constexpr,
    DTYPE: tl.constexpr,
    USE_PTX: tl.constexpr,
):
    """[ROWS, WORDS] int32 words of eight int4 (``SIGNED``) or uint4 codes -> [ROWS, 8*WORDS]
    integers in code order, as float32, float16 or bfloat16 (``DTYPE``, exact in each).

    Words are laid out by ``qscheme.triton.layout.four_bit_words``: pair i (codes 2i, 2i+1) is
    ``(word >> 4i) & 0x000F000F``; one more logical operation makes it two 16-bit floats worth
    128 (1024 for float16) plus the code (plus 8 for int4, whose sign bit it flips), and one
    subtraction per pair gives the integers. float32 is read from the bfloat16 patterns.
    """
    bits = (_FP16_1024 if DTYPE == DECODE_FP16 else _BF16_128) | (_INT4_FLIP if SIGNED else 0)
    offset = (1024.0 if DTYPE == DECODE_FP16 else 128.0) + (8.0 if SIGNED else 0.0)
    e0, e1 = _split_pair((words & _INT4_PAIR) ^ bits, DTYPE, USE_PTX)
    e2, e3 = _split_pair(((words >> 4) & _INT4_PAIR) ^ bits, DTYPE, USE_PTX)
    e4, e5 = _split_pair(((words >> 8) & _INT4_PAIR) ^ bits, DTYPE, USE_PTX)
    e6, e7 = _split_pair(((words >> 12) & _INT4_PAIR) ^ bits, DTYPE, USE_PTX)
    values = _join_pairs(e0, e1, e2, e3, e4, e5, e6, e7, ROWS, WORDS)
    return values - tl.full(values.shape, offset, values.dtype)  # in the decode dtype, exact


@triton.jit
def decode_e2m1_words(
    words,
    ROWS: tl.constexpr,
    WORDS: tl.constexpr,
    DTYPE: tl.constexpr,
    USE_PTX: tl.constexpr,
    UNSCALED: tl.constexpr = False,
):
    """[ROWS, WORDS] int32 words of eight e2m1 codes -> [ROWS, 8*WORDS] values in code order.

    Words are laid out by ``qscheme.triton.layout.four_bit_words``: each pair of consecutive codes
    (the tensor cores' operand pair) comes out of a word as one 32-bit register of two bfloat16
    patterns, in 9 integer operations per word and with no byte permutes. A multiply by 2**126
    (exact, subnormals included) turns the patterns into the values. ``DTYPE`` (a decode id):
    bfloat16 (the GPU's bf16 dot path), float32, or float16, whose patterns (worth 2**-14 times
    the values) take two more operations per pair. Code 0x8 gives -0.0, equal to +0.0.
    ``UNSCALED`` leaves the multiply by 2**126 (2**14) out for a caller that folds the power of
    two into its own scale.
    """
    # The arithmetic shift's sign copies are masked off; the multiply's copies never overlap.
    spread = ((words >> 7) & _E2M1_SPREAD_BITS) * _E2M1_SPREAD
    if DTYPE == DECODE_FP16:  # the sign stays, the other three bits move 3 higher
        shifted3 = words << 3
        shifted6 = words << 6
        spread = spread & _E2M1_PAIR_BITS
        e0, e1 = _split_pair((words & _PAIR_SIGNS) | (shifted3 & _FP16_E2M1_BITS), DTYPE, USE_PTX)
        e2, e3 = _split_pair((shifted3 & _PAIR_SIGNS) | (shifted6 & _FP16_E2M1_BITS), DTYPE, USE_PTX)
        e4, e5 = _split_pair((shifted6 & _PAIR_SIGNS) | ((words << 9) & _FP16_E2M1_BITS), DTYPE, USE_PTX)
        e6, e7 = _split_pair((spread & _PAIR_SIGNS) | ((spread << 3) & _FP16_E2M1_BITS), DTYPE, USE_PTX)
    else:
        e0, e1 = _split_pair(words & _E2M1_PAIR_BITS, DTYPE, USE_PTX)
        e2, e3 = _split_pair((words << 3) & _E2M1_PAIR_BITS, DTYPE, USE_PTX)
        e4, e5 = _split_pair((words << 6) & _E2M1_PAIR_BITS, DTYPE, USE_PTX)
        e6, e7 = _split_pair(spread & _E2M1_PAIR_BITS, DTYPE, USE_PTX)
    values = _join_pairs(e0, e1, e2, e3, e4, e5, e6, e7, ROWS, WORDS)
    if UNSCALED:
        return values
    elif DTYPE == DECODE_FP16:  # constants as tensors of the values' dtype: no promotion
        return values * tl.full(values.shape, _TWO_POW_14, values.dtype)
    else:
        return values * tl.full(values.shape, _TWO_POW_126, values.dtype)


@triton.jit
def decode_e4m3(codes):
    """float8_e4m3fn bits (uint8) -> float32, NaN for 0x7F/0xFF."""
    bits = codes.to(tl.int32) & 0xFF
    exponent = (bits >> 3) & 0xF
    mantissa = bits & 0x7
    normal = tl.where((exponent == 15) & (mantissa == 7), _F32_NAN_BITS, ((exponent + 120) << 23) | (mantissa << 20))
    subnormal = mantissa.to(tl.float32) * 0.001953125  # m * 2**-9, exact
    magnitude = tl.where(exponent == 0, subnormal, normal.to(tl.float32, bitcast=True))
    return tl.where((bits & 0x80) != 0, -magnitude, magnitude)


@triton.jit
def decode_e5m2(codes):
    """float8_e5m2 bits (uint8) -> float32: e5m2 is the upper byte of a float16."""
    half = ((codes.to(tl.int32) & 0xFF) << 8).to(tl.int16).to(tl.float16, bitcast=True)
    return half.to(tl.float32)


@triton.jit
def decode_e8m0(codes):
    """e8m0 bytes -> float32 2**(byte-127); byte 0 is 2**-127 (subnormal), 255 is NaN."""
    exponent = codes.to(tl.int32) & 0xFF
    bits = tl.where(exponent == 0, 0x00400000, exponent << 23)
    bits = tl.where(exponent == 255, _F32_NAN_BITS, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def decode_element(codes, FORMAT: tl.constexpr, NATIVE_FP8: tl.constexpr = False):
    """Codes of an element format -> float32 (4-bit codes already unpacked, one per value).

    ``NATIVE_FP8`` decodes e4m3 with the hardware conversion (compute capability 8.9 or newer):
    one instruction for two values instead of a dozen integer operations per value.
    """
    if FORMAT == E4M3 and NATIVE_FP8:
        return codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    elif FORMAT == E2M1:
        return decode_e2m1(codes)
    elif FORMAT == INT4:
        return (((codes.to(tl.int32) & 0xF) ^ 0x8) - 0x8).to(tl.float32)
    elif FORMAT == UINT4:
        return (codes.to(tl.int32) & 0xF).to(tl.float32)
    elif FORMAT == E4M3:
        return decode_e4m3(codes)
    elif FORMAT == E5M2:
        return decode_e5m2(codes)
    else:  # INT8 and UINT8 are loaded with their own signedness
        return codes.to(tl.float32)


@triton.jit
def decode_scale(stored, FORMAT: tl.constexpr, NATIVE_FP8: tl.constexpr = False):
    """A loaded scale -> float32: e4m3 and e8m0 come as uint8 bits, floats as themselves.

    ``NATIVE_FP8`` decodes e4m3 with the hardware conversion (compute capability 8.9 or newer).
    """
    if FORMAT == SCALE_E4M3 and NATIVE_FP8:
        return stored.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    elif FORMAT == SCALE_E4M3:
        return decode_e4m3(stored)
    elif FORMAT == SCALE_E8M0:
        return decode_e8m0(stored)
    else:
        return stored.to(tl.float32)
