"""The inline-PTX 4-bit decoders (qscheme.triton.asm_decode): their programs, emulated on the
host op by op, give the pure decoders' results bit for bit for every byte value at every byte
position of a word (and random words); on a GPU the compiled PTX is compared with the pure
decoders directly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from qscheme.catalog import load_scheme
from qscheme.errors import UsageError
from qscheme.triton import asm_decode as asm
from qscheme.triton import linear as lin
from qscheme.triton.decode import (
    DECODE_BF16,
    DECODE_FP16,
    DECODE_FP32,
    E2M1,
    INT4,
    decode_e2m1_words,
    decode_int4_words,
)
from qscheme.triton.layout import canonical_from_words
from qscheme.triton.samples import random_weight
from qscheme.triton.spec import ELEMENT_IDS

# e2m1 magnitudes, from the format's definition (1 sign, 2 exponent bits with bias 1, 1 mantissa bit)
E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
CASES = [
    ("int4", asm.BF16, False),
    ("uint4", asm.BF16, False),
    ("int4", asm.FP16, False),
    ("uint4", asm.FP16, False),
    ("e2m1", asm.BF16, False),
    ("e2m1", asm.BF16, True),
]
IDS = [
    f"{fmt}-{'bf16' if dtype == asm.BF16 else 'fp16'}{'-unscaled' if unscaled else ''}"
    for fmt, dtype, unscaled in CASES
]


def test_words() -> np.ndarray:
    """Every byte value at each byte position (the other bytes 0, then all four alike), and
    random words: 2048 uint32 words."""
    single = [value << (8 * position) for position in range(4) for value in range(256)]
    repeated = [value * 0x01010101 for value in range(256)]
    rng = np.random.default_rng(16)
    random = rng.integers(0, 1 << 32, size=2048 - len(single) - len(repeated), dtype=np.uint64).tolist()
    return np.array(single + repeated + random, dtype=np.uint64)


test_words.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test


@triton.jit
def _pure_kernel(w_ptr, out_ptr, ROWS: tl.constexpr, WORDS: tl.constexpr, FORMAT: tl.constexpr, UNSCALED: tl.constexpr):
    rows = tl.arange(0, ROWS)
    words = tl.load(w_ptr + rows[:, None] * WORDS + tl.arange(0, WORDS)[None, :])
    if FORMAT == E2M1:
        values = decode_e2m1_words(words, ROWS, WORDS, DECODE_FP32, False, UNSCALED)
    else:
        values = decode_int4_words(words, ROWS, WORDS, FORMAT == INT4, DECODE_FP32, False)
    tl.store(out_ptr + rows[:, None] * (8 * WORDS) + tl.arange(0, 8 * WORDS)[None, :], values)


def pure_decode(words: np.ndarray, fmt: str, unscaled: bool) -> torch.Tensor:
    """The pure decoder (float32 path: exact, and the interpreter runs it) -> float32 [..., 8]."""
    signed = torch.from_numpy(words.astype(np.int64)).reshape(-1, 8)
    signed = torch.where(signed >= 1 << 31, signed - (1 << 32), signed).to(torch.int32)
    out = torch.empty(signed.shape[0], 64, dtype=torch.float32)
    _pure_kernel[(1,)](signed, out, signed.shape[0], 8, ELEMENT_IDS[fmt], unscaled)
    return out.reshape(-1, 8)


def canonical_values(words: np.ndarray, fmt: str) -> torch.Tensor:
    """The codes' values from the layout's inverse and the formats' definitions -> float64 [..., 8]."""
    signed = torch.from_numpy(words.astype(np.int64))
    signed = torch.where(signed >= 1 << 31, signed - (1 << 32), signed).to(torch.int32).reshape(-1, 1)
    packed = canonical_from_words(signed, 4, fmt).to(torch.int64)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(-1, 8)
    if fmt == "e2m1":
        magnitude = torch.tensor(E2M1_VALUES, dtype=torch.float64)[codes & 0x7]
        return torch.where(codes >= 8, -magnitude, magnitude)
    if fmt == "int4":
        return torch.where(codes >= 8, codes - 16, codes).to(torch.float64)
    return codes.to(torch.float64)


def as_patterns(values: torch.Tensor, dtype: int) -> np.ndarray:
    """float values (exact in the 16-bit dtype) -> their uint16 patterns."""
    half = values.to(torch.float16 if dtype == asm.FP16 else torch.bfloat16)
    assert torch.equal(half.double(), values.double()), "reference values must be exact in the 16-bit dtype"
    return half.view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize(("fmt", "dtype", "unscaled"), CASES, ids=IDS)
def test_the_emulated_program_gives_the_pure_decoders_bits(fmt: str, dtype: int, unscaled: bool) -> None:
    words = test_words()
    program = asm.program_for(fmt, dtype, unscaled)
    assert program is not None
    emulated = asm.emulate(program, words, dtype)
    pure = pure_decode(words, fmt, unscaled)
    # the pure float32 path gives the same patterns as its 16-bit paths (every value is exact)
    np.testing.assert_array_equal(emulated, as_patterns(pure, dtype), err_msg=f"{fmt}: asm vs pure decoder")
    # and both are the codes' values (times 2**-126 unscaled), negative zero for e2m1's code 8
    expected = canonical_values(words, fmt) * (2.0**-126 if unscaled else 1.0)
    np.testing.assert_array_equal(emulated, as_patterns(expected, dtype), err_msg=f"{fmt}: asm vs the format")


@pytest.mark.parametrize("scale", [0.0078125, 0.01171875, 0.3359375, 1.0, 2.75, 117.0, 3.0e-3])
def test_scaled_products_match_and_an_offset_fma_would_not(scale: float) -> None:
    """The group scale multiplies the decoded pairs afterwards (one packed multiply per pair,
    rounded once), as in the pure path. Folding it into the int4 offset's fma,
    fma(136 + q, s, -136 * s), rounds differently wherever 136 * s is not exact in bfloat16:
    the reason the decoders leave the scale out."""
    words = test_words()
    s = float(torch.tensor(scale).to(torch.bfloat16))
    s_bits = asm._half_bits(s, asm.BF16)
    emulated = asm.emulate(asm.int4_program(True, asm.BF16), words, asm.BF16)
    pairs = emulated[..., 0::2].astype(np.uint64) | (emulated[..., 1::2].astype(np.uint64) << 16)
    scaled = asm._packed_fma(pairs, np.full_like(pairs, s_bits), np.full_like(pairs, 0x80008000), asm.BF16)
    pure = pure_decode(words, "int4", False)
    expected = as_patterns((pure.double() * s).float().to(torch.bfloat16).double(), asm.BF16)  # one rounding
    np.testing.assert_array_equal(scaled & 0xFFFF, expected[..., 0::2])
    np.testing.assert_array_equal(scaled >> 16, expected[..., 1::2])
    # the folded variant: fma(136 + q, s, bf16(-136 * s)), one rounding of the exact sum
    magic = canonical_values(words, "int4") + 136.0
    offset = float(torch.tensor(-136.0 * s, dtype=torch.float64).to(torch.float32).to(torch.bfloat16))
    folded = asm._from_float((magic * s + offset).numpy(), asm.BF16).astype(np.uint16)
    exact_offset = offset == -136.0 * s
    differs = not np.array_equal(folded, expected)
    assert differs != exact_offset, f"scale {s}: offset exact {exact_offset}, folded result differs {differs}"


def test_lop3_tables_follow_ptx_rule() -> None:
    # Marlin's int4 decode uses (a & b) | c as 0xEA; and/xor is 0x6A
    assert asm.lop3_lut(lambda a, b, c: (a & b) | c) == 0xEA
    assert asm.lop3_lut(lambda a, b, c: (a & b) ^ c) == 0x6A
    a, b, c = (np.array([x], dtype=np.uint64) for x in (0x12345678, 0x0F0F0F0F, 0xFFFF0000))
    assert int(asm._lop3(a, b, c, 0x6A)[0]) == (0x12345678 & 0x0F0F0F0F) ^ 0xFFFF0000


@pytest.mark.parametrize(("fmt", "dtype", "unscaled"), CASES, ids=IDS)
def test_the_ptx_is_the_program(fmt: str, dtype: int, unscaled: bool) -> None:
    program = asm.program_for(fmt, dtype, unscaled)
    assert program is not None
    lines = asm.render_ptx(program).splitlines()
    body = lines[2:-5]
    assert lines[0] == "{" and lines[-1] == "}" and lines[1].startswith(".reg .b32 ")
    assert len(body) == len(program)
    for line, op in zip(body, program, strict=True):
        assert line.split()[1].rstrip(",") == op.dst and line.startswith(asm._PTX[op.name].split()[0])
    assert lines[-5:-1] == [f"mov.b32 {{${2 * p}, ${2 * p + 1}}}, p{p};" for p in range(4)]


def test_formats_without_a_program_keep_the_pure_decoder() -> None:
    assert asm.program_for("e2m1", asm.FP16) is None
    assert asm.program_for("int4", DECODE_FP32) is None
    assert asm.program_for("e4m3", asm.BF16) is None
    assert (asm.BF16, asm.FP16) == (DECODE_BF16.value, DECODE_FP16.value)


@pytest.mark.parametrize("setting", ["", "0", "1"])
@pytest.mark.parametrize(
    ("name", "default"), [("compressed-tensors/W4A16", True), ("compressed-tensors/NVFP4A16", False)]
)
def test_asm_decode_is_set_for_cuda_launches_only(
    name: str, default: bool, setting: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unset: int4 takes the asm decoder (its static count goes down), e2m1 the pure one (same
    SASS); 1 / 0 force it on / off; never outside CUDA."""
    monkeypatch.setenv(lin.ASM_DECODE_VARIABLE, setting)
    prepared = lin.prepare_weight(random_weight(load_scheme(name), 64, 128), "cpu")
    x, out = torch.zeros(1, 128, dtype=torch.bfloat16), torch.empty(1, 64, dtype=torch.bfloat16)
    tile = lin.configs.interpreted_config(1, 64, 128)
    expected = {"": default, "0": False, "1": True}[setting]
    for backend in ("cuda", "hip", "interpreter"):
        launch = lin.gemm_launches(
            prepared, prepared.segments[0], x, None, None, out, tile, torch.bfloat16, backend, False
        )[0]
        assert launch.constexprs["ASM_DECODE"] is (expected and backend == "cuda"), backend


def test_a_bad_asm_decode_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(lin.ASM_DECODE_VARIABLE, "yes")
    spec = lin.prepare_weight(random_weight(load_scheme("compressed-tensors/W4A16"), 64, 128), "cpu").spec
    with pytest.raises(UsageError, match="QSCHEME_TRITON_ASM_DECODE='yes': expected 0 or 1"):
        lin.asm_decode_enabled(spec)


@triton.jit
def _device_kernel(w_ptr, asm_ptr, pure_ptr, FORMAT: tl.constexpr, DTYPE: tl.constexpr, UNSCALED: tl.constexpr):
    rows = tl.arange(0, 256)
    words = tl.load(w_ptr + rows[:, None] * 8 + tl.arange(0, 8)[None, :])
    out = rows[:, None] * 64 + tl.arange(0, 64)[None, :]
    if FORMAT == E2M1:
        tl.store(asm_ptr + out, asm.asm_decode_e2m1_words(words, 256, 8, UNSCALED))
        tl.store(pure_ptr + out, decode_e2m1_words(words, 256, 8, DTYPE, True, UNSCALED))
    else:
        tl.store(asm_ptr + out, asm.asm_decode_int4_words(words, 256, 8, FORMAT == INT4, DTYPE))
        tl.store(pure_ptr + out, decode_int4_words(words, 256, 8, FORMAT == INT4, DTYPE, True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(lin.interpreted(), reason="inline assembly needs compiled kernels (TRITON_INTERPRET=0)")
@pytest.mark.parametrize(("fmt", "dtype", "unscaled"), CASES, ids=IDS)
def test_asm_and_pure_decoders_agree_on_the_gpu(fmt: str, dtype: int, unscaled: bool) -> None:
    words = test_words()
    signed = torch.from_numpy(words.astype(np.int64))
    signed = torch.where(signed >= 1 << 31, signed - (1 << 32), signed).to(torch.int32).reshape(256, 8).cuda()
    torch_dtype = torch.float16 if dtype == asm.FP16 else torch.bfloat16
    from_asm = torch.empty(256, 64, dtype=torch_dtype, device="cuda")
    from_pure = torch.empty_like(from_asm)
    _device_kernel[(1,)](signed, from_asm, from_pure, ELEMENT_IDS[fmt], dtype, unscaled)
    assert torch.equal(from_asm.view(torch.int16), from_pure.view(torch.int16)), f"{fmt}: asm vs pure on the GPU"
    emulated = asm.emulate(asm.program_for(fmt, dtype, unscaled), words, dtype)  # type: ignore[arg-type]
    assert np.array_equal(from_asm.view(torch.int16).cpu().numpy().view(np.uint16).reshape(-1, 8), emulated)
