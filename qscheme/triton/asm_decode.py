"""4-bit word decoders as inline PTX (CUDA only), with a host emulator of the same program.

The pure-Triton decoders of ``qscheme.triton.decode`` cut each pair of codes out of an int32
word (``qscheme.triton.layout``) as one register of two 16-bit float patterns and leave the
instruction choice to the compiler. The decoders here write the same cuts as PTX: ``lop3.b32``
(mask and magic exponent in one operation), shifts, one multiply that spreads e2m1's fourth
pair, and packed ``fma.rn.{bf16x2,f16x2}`` for the int4 offset or e2m1's power of two; each pair
register is then split into its two halves with one ``mov``.

A program is data (``Program``: a tuple of ``Op``), so the PTX string the kernel compiles and
the host emulation that proves it (``emulate``) are made from the same list: the tests run the
emulation over every byte value at every position of a word and compare it, bit for bit, with
the pure decoder's results. The interpreter cannot run inline assembly; the kernels keep the
pure decoders there (``ASM_DECODE`` is only set for CUDA launches).

Covered: int4 and uint4 in bfloat16 and float16, e2m1 in bfloat16 (scaled by 2**126, or
unscaled for a folded scale). e2m1 in float16 and every float32 decode stay pure.

Why the group scale is not folded into the packed fma: for int4 that would be
``fma(128 + 8 + q, s, -136 * s)``, exact only where ``136 * s`` is representable in the 16-bit
dtype (17 times the scale's significand, rarely), so it would round differently from the pure
``(v - 136) * s``; e2m1's power of two is already folded into its e4m3 scales by the pure path.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import triton
import triton.language as tl

from qscheme.triton.decode import DECODE_BF16, DECODE_FP16

# Decode ids (the values of decode.DECODE_*, for the host side).
BF16 = 2
FP16 = 1

_INT4_PAIR = 0x000F000F
_E2M1_PAIR_BITS = 0x81C081C0
_E2M1_SPREAD_BITS = 0x00D800D8
_E2M1_SPREAD = 1 + (1 << 5) + (1 << 11)


def lop3_lut(function: Callable[[int, int, int], int]) -> int:
    """The ``lop3.b32`` immediate of a bitwise function of a, b, c, by PTX's rule: the function
    applied to a = 0xF0, b = 0xCC, c = 0xAA."""
    return function(0xF0, 0xCC, 0xAA) & 0xFF


_AND_XOR = lop3_lut(lambda a, b, c: (a & b) ^ c)


@dataclass(frozen=True)
class Op:
    """One PTX instruction: ``name`` (see ``_PTX``), destination register, sources (register
    names or 32-bit immediates)."""

    name: str
    dst: str
    srcs: tuple[str | int, ...]


Program = tuple[Op, ...]
# An op's PTX; packed float ops take their constants from registers (mov'd first).
_PTX = {
    "lop3": "lop3.b32 {dst}, {0}, {1}, {2}, {3};",
    "and": "and.b32 {dst}, {0}, {1};",
    "shl": "shl.b32 {dst}, {0}, {1};",
    "shr": "shr.u32 {dst}, {0}, {1};",
    "mul": "mul.lo.u32 {dst}, {0}, {1};",
    "mov": "mov.b32 {dst}, {0};",
    "fma_bf16x2": "fma.rn.bf16x2 {dst}, {0}, {1}, {2};",
    "fma_f16x2": "fma.rn.f16x2 {dst}, {0}, {1}, {2};",
}
_INPUT = "w"  # the word register; pairs are p0..p3 (codes 2i, 2i + 1)


def _half_bits(value: float, dtype: int) -> int:
    """The 16-bit pattern of ``value`` (exact) in bfloat16 or float16, repeated in both halves."""
    if dtype == FP16:
        bits = struct.unpack("<H", struct.pack("<e", value))[0]
        if struct.unpack("<e", struct.pack("<H", bits))[0] != value:
            raise ValueError(f"{value} is not exact in float16")
    else:
        single = struct.unpack("<I", struct.pack("<f", value))[0]
        if single & 0xFFFF:
            raise ValueError(f"{value} is not exact in bfloat16")
        bits = single >> 16
    return bits | (bits << 16)


def _fma(dtype: int) -> str:
    return "fma_f16x2" if dtype == FP16 else "fma_bf16x2"


def int4_program(signed: bool, dtype: int) -> Program:
    """int4 (``signed``) or uint4 words -> four pair registers of exact integers (16-bit floats).

    Pair i is ``(word >> 4i) & 0x000F000F`` ORed with the exponent of 128 (bfloat16) or 1024
    (float16), int4's sign bit flipped (one lop3: ``(a & b) ^ c``); ``fma(pair, 1, -offset)``
    then gives the integers, exactly (the pure decoder's subtraction).
    """
    magic = (0x64006400 if dtype == FP16 else 0x43004300) | (0x00080008 if signed else 0)
    offset = (1024.0 if dtype == FP16 else 128.0) + (8.0 if signed else 0.0)
    ops: list[Op] = [Op("mov", "one", (_half_bits(1.0, dtype),)), Op("mov", "off", (_half_bits(-offset, dtype),))]
    for pair in range(4):
        source = _INPUT
        if pair:
            ops.append(Op("shr", "t", (_INPUT, 4 * pair)))
            source = "t"
        ops.append(Op("lop3", f"p{pair}", (source, _INT4_PAIR, magic, _AND_XOR)))
        ops.append(Op(_fma(dtype), f"p{pair}", (f"p{pair}", "one", "off")))
    return tuple(ops)


def e2m1_program(unscaled: bool) -> Program:
    """e2m1 words -> four pair registers of bfloat16 values (times 2**-126 when ``unscaled``).

    The cuts of ``qscheme.triton.layout.E2M1_WORD_BITS``: pairs 0-2 masked in place after
    shifts of 0, 3 and 6; pair 3 spread back by one multiply. ``fma(pair, 2**126, -0)``
    multiplies exactly (subnormal patterns included; -0 keeps every product's sign).
    """
    ops: list[Op] = [
        Op("and", "p0", (_INPUT, _E2M1_PAIR_BITS)),
        Op("shl", "t", (_INPUT, 3)),
        Op("and", "p1", ("t", _E2M1_PAIR_BITS)),
        Op("shl", "t", (_INPUT, 6)),
        Op("and", "p2", ("t", _E2M1_PAIR_BITS)),
        Op("shr", "t", (_INPUT, 7)),
        Op("and", "t", ("t", _E2M1_SPREAD_BITS)),
        Op("mul", "t", ("t", _E2M1_SPREAD)),
        Op("and", "p3", ("t", _E2M1_PAIR_BITS)),
    ]
    if not unscaled:
        ops.append(Op("mov", "k", (_half_bits(2.0**126, BF16),)))
        ops.append(Op("mov", "z", (0x80008000,)))  # -0.0 in both halves
        ops.extend(Op("fma_bf16x2", f"p{pair}", (f"p{pair}", "k", "z")) for pair in range(4))
    return tuple(ops)


def program_for(fmt: str, dtype: int, unscaled: bool = False) -> Program | None:
    """The program of an element format ("e2m1", "int4", "uint4") and decode id, or None
    where the pure decoder is kept."""
    if fmt in ("int4", "uint4") and dtype in (BF16, FP16):
        return int4_program(fmt == "int4", dtype)
    if fmt == "e2m1" and dtype == BF16:
        return e2m1_program(unscaled)
    return None


def _operand(source: str | int) -> str:
    """A register name, ``$8`` for the word, or an immediate (small ones, such as shift amounts
    and lop3 tables, in decimal)."""
    if source == _INPUT:
        return "$8"
    if isinstance(source, int):
        return str(source) if source <= 0xFF else f"0x{source & 0xFFFFFFFF:08x}"
    return source


def render_ptx(program: Program) -> str:
    """The inline-asm body: outputs $0..$7 (the codes' 16-bit values in code order), input $8."""
    registers = sorted({op.dst for op in program} | {"t"})
    lines = ["{", f".reg .b32 {', '.join(registers)};"]
    for op in program:
        sources = [_operand(source) for source in op.srcs]
        lines.append(_PTX[op.name].format(*sources, dst=op.dst))
    lines.extend(f"mov.b32 {{${2 * pair}, ${2 * pair + 1}}}, p{pair};" for pair in range(4))
    lines.append("}")
    return "\n".join(lines)


# ---- host emulation (numpy, bit exact) -------------------------------------------------------


def _to_float(halves: np.ndarray, dtype: int) -> np.ndarray:
    """uint32 16-bit patterns -> float64 values (exact)."""
    if dtype == FP16:
        return halves.astype(np.uint16).view(np.float16).astype(np.float64)
    return (halves.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _from_float(values: np.ndarray, dtype: int) -> np.ndarray:
    """float64 values -> uint32 16-bit patterns, rounded to nearest even (from float32, which
    must hold the values exactly: one rounding only)."""
    single = values.astype(np.float32)
    if not np.array_equal(single.astype(np.float64), values, equal_nan=True):
        raise ValueError("emulated fma result not exact in float32: the emulation would round twice")
    if dtype == FP16:
        return single.astype(np.float16).view(np.uint16).astype(np.uint32)
    bits = single.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even (no NaN here)
    return rounded.astype(np.uint32)


def _packed_fma(a: np.ndarray, b: np.ndarray, c: np.ndarray, dtype: int) -> np.ndarray:
    out = np.zeros_like(a)
    for shift in (0, 16):
        x, y, z = ((v >> shift) & 0xFFFF for v in (a, b, c))
        out |= _from_float(_to_float(x, dtype) * _to_float(y, dtype) + _to_float(z, dtype), dtype) << shift
    return out


def _lop3(a: np.ndarray, b: np.ndarray, c: np.ndarray, lut: int) -> np.ndarray:
    out = np.zeros_like(a)
    for index in range(8):  # PTX: bit i of the lut is f at (a, b, c) = the bits of i (a highest)
        if lut >> index & 1:
            pick_a = a if index & 4 else ~a
            pick_b = b if index & 2 else ~b
            pick_c = c if index & 1 else ~c
            out |= pick_a & pick_b & pick_c
    return out & 0xFFFFFFFF


def emulate(program: Program, words: np.ndarray, dtype: int) -> np.ndarray:
    """Run ``program`` on uint32 ``words`` [...] -> uint16 patterns [..., 8] in code order.

    ``dtype``: the decode id the packed fmas work in (bfloat16 or float16)."""
    mask = np.uint64(0xFFFFFFFF)
    registers: dict[str, np.ndarray] = {_INPUT: words.astype(np.uint64) & mask}

    def value(source: str | int) -> np.ndarray:
        if isinstance(source, int):
            return np.full(words.shape, source & 0xFFFFFFFF, dtype=np.uint64)
        return registers[source]

    for op in program:
        s = [value(source) for source in op.srcs]
        if op.name == "lop3":
            result = _lop3(s[0], s[1], s[2], int(op.srcs[3]))
        elif op.name == "and":
            result = s[0] & s[1]
        elif op.name == "shl":
            result = (s[0] << s[1]) & mask
        elif op.name == "shr":
            result = s[0] >> s[1]
        elif op.name == "mul":
            result = (s[0] * s[1]) & mask
        elif op.name == "mov":
            result = s[0]
        elif op.name in ("fma_bf16x2", "fma_f16x2"):
            result = _packed_fma(s[0], s[1], s[2], FP16 if op.name == "fma_f16x2" else BF16)
        else:
            raise ValueError(f"no emulation for op {op.name!r}")
        registers[op.dst] = result & mask
    pairs = [registers[f"p{pair}"] for pair in range(4)]
    halves = [half for pair in pairs for half in (pair & 0xFFFF, pair >> 16)]
    return np.stack(halves, axis=-1).astype(np.uint16)


# ---- the jitted decoders ---------------------------------------------------------------------

_PTX_INT4_BF16: tl.constexpr = tl.constexpr(render_ptx(int4_program(True, BF16)))
_PTX_UINT4_BF16: tl.constexpr = tl.constexpr(render_ptx(int4_program(False, BF16)))
_PTX_INT4_FP16: tl.constexpr = tl.constexpr(render_ptx(int4_program(True, FP16)))
_PTX_UINT4_FP16: tl.constexpr = tl.constexpr(render_ptx(int4_program(False, FP16)))
_PTX_E2M1_BF16: tl.constexpr = tl.constexpr(render_ptx(e2m1_program(False)))
_PTX_E2M1_BF16_UNSCALED: tl.constexpr = tl.constexpr(render_ptx(e2m1_program(True)))
_OUTPUTS: tl.constexpr = tl.constexpr("=h,=h,=h,=h,=h,=h,=h,=h,r")


@triton.jit
def _run(words, PTX: tl.constexpr, DTYPE: tl.constexpr):
    if DTYPE == DECODE_FP16:
        return tl.inline_asm_elementwise(PTX, _OUTPUTS, [words], dtype=(tl.float16,) * 8, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(PTX, _OUTPUTS, [words], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)


@triton.jit
def _join(e0, e1, e2, e3, e4, e5, e6, e7, ROWS: tl.constexpr, WORDS: tl.constexpr):
    even = tl.join(tl.join(e0, e4), tl.join(e2, e6))
    odd = tl.join(tl.join(e1, e5), tl.join(e3, e7))
    return tl.reshape(tl.join(even, odd), (ROWS, WORDS * 8))


@triton.jit
def asm_decode_int4_words(words, ROWS: tl.constexpr, WORDS: tl.constexpr, SIGNED: tl.constexpr, DTYPE: tl.constexpr):
    """``decode.decode_int4_words`` for bfloat16 and float16, in PTX (CUDA only)."""
    if DTYPE == DECODE_FP16:
        if SIGNED:
            e0, e1, e2, e3, e4, e5, e6, e7 = _run(words, _PTX_INT4_FP16, DTYPE)
        else:
            e0, e1, e2, e3, e4, e5, e6, e7 = _run(words, _PTX_UINT4_FP16, DTYPE)
    elif SIGNED:
        e0, e1, e2, e3, e4, e5, e6, e7 = _run(words, _PTX_INT4_BF16, DTYPE)
    else:
        e0, e1, e2, e3, e4, e5, e6, e7 = _run(words, _PTX_UINT4_BF16, DTYPE)
    return _join(e0, e1, e2, e3, e4, e5, e6, e7, ROWS, WORDS)


@triton.jit
def asm_decode_e2m1_words(words, ROWS: tl.constexpr, WORDS: tl.constexpr, UNSCALED: tl.constexpr):
    """``decode.decode_e2m1_words`` for bfloat16, in PTX (CUDA only)."""
    if UNSCALED:
        e0, e1, e2, e3, e4, e5, e6, e7 = _run(words, _PTX_E2M1_BF16_UNSCALED, DECODE_BF16)
    else:
        e0, e1, e2, e3, e4, e5, e6, e7 = _run(words, _PTX_E2M1_BF16, DECODE_BF16)
    return _join(e0, e1, e2, e3, e4, e5, e6, e7, ROWS, WORDS)
