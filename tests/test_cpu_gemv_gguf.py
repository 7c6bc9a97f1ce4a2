"""The ``cpu_gemv_blocks`` kernel (qscheme._cpu_gemv.gemv_blocks, C++) against the reference kernel.

Every GGUF type its declaration claims, as real GGUF blocks: qscheme's GGUF quantizer
(``quantize_blocks``, bit-identical to llama.cpp's reference quantizers: tests/test_gguf_quants.py
and tests/test_gguf_quantize.py check it against llama.cpp itself) quantizes a random float32
weight, and the bytes are canonicalized as a loaded GGUF file's are. Each runs on every loop this
CPU has (AVX-512, AVX2) and on the portable one, with ragged N (not a multiple of the loops' 4 or
2 rows, nor of the 64-row tasks), M = 0, 1, 4, 9 (three passes of at most 4 rows), a 3-D input,
a bias, bfloat16, float16 and float32 inputs, and 1 or 2 worker threads. The reference kernel
decodes the blocks as llama.cpp does, bit for bit (tests/test_formats_blocks.py).

The bound is the declaration's: per output, 2 * (K + 8) * 2**-24 * sum_k |x_k| (|s_k v_k| + |m_k|),
with s_k v_k the weight without its minimum and m_k the minimum, both from the reference decoder
(the declaration decoded with and without its minimum), plus for 16-bit outputs one rounding of
each side's output (one unit in the last place).

The AVX512-BF16 loop (bfloat16 inputs on the 4-bit types in sub-blocks of 32 and on the 2- to 6-bit
integer codes, on a CPU with AVX512-BF16 and VBMI): which types it takes (``dot_loop``), its float32
sums and the float32 loops' on the same inputs, each within the bound of the reference (rows with an
odd number of sub-blocks where the blocks allow it, M up to 6: two passes), and the inputs outside
its range falling back to the float32 loops.

Also: the resolver's plan on a CPU (this kernel for M <= 15, below tinygemm_cpu), the state holds
the canonical blocks (no copy) and one program per scheme, the op's fake implementation
(opcheck, torch.compile), and typed refusals.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import pytest
import torch
from cpu_features import cpu_flags
from kernel_fakes import all_modules, builtin_scheme, builtin_schemes, fake_device
from qscheme_plugins.cpu_gemv_blocks import CPU_GEMV_BLOCKS, Bf16BlockLoop, NativeBlockLoops
from qscheme_plugins.cpu_gemv_blocks_kernel import CpuGemvBlocksKernel
from qscheme_plugins.reference_kernel import ReferenceKernel

from qscheme import cpu_gemv, cpu_gemv_blocks, tile_gemm
from qscheme.canonical import CanonicalWeight
from qscheme.canonical_blocks import canonical_blocks
from qscheme.errors import UsageError
from qscheme.formats.blocks import decode_blocks
from qscheme.kernels import registry
from qscheme.kernels.problem import Problem
from qscheme.kernels.resolver import SchemeFeatures, check_scheme, resolve
from qscheme.modules import QuantLinear
from qscheme.producers.gguf.quants.api import quantize_blocks

pytestmark = pytest.mark.skipif(
    not cpu_gemv.available() or not hasattr(cpu_gemv.native(), "gemv_blocks"),
    reason="qscheme._cpu_gemv (with gemv_blocks) is not built",
)

CPU = torch.device("cpu")
GGUF = sorted(scheme.name for scheme in builtin_schemes() if scheme.name.startswith("gguf/"))
CLAIMED = [name for name in GGUF if check_scheme(CPU_GEMV_BLOCKS, SchemeFeatures.of(builtin_scheme(name)))[0]]
# Written out: the types issue 29 names, and the others of the brief, must be claimed
EXPECTED = {"gguf/Q4_0", "gguf/Q8_0", "gguf/Q4_K", "gguf/Q6_K", "gguf/IQ4_NL", "gguf/IQ4_XS", "gguf/Q5_0", "gguf/Q5_K"}
FLOAT_TYPES = {"gguf/F32", "gguf/F16", "gguf/BF16"}
TINYGEMM_TYPES = {"gguf/Q4_0", "gguf/Q4_1", "gguf/Q4_K"}  # affine 4-bit blocks: tinygemm_cpu's with bf16 inputs
ISAS = ("scalar", "avx2", "avx512")
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# (input shape without K, dtype, bias, threads)
CASES = (
    ((1,), BF16, True, 1),
    ((1,), FP32, False, 2),
    ((4,), BF16, False, 2),
    ((4,), FP32, True, 1),
    ((2, 3), BF16, True, 2),
    ((9,), FP32, True, 2),
    ((1,), FP16, True, 1),
    ((0,), BF16, True, 1),
)


def _isa_param(name: str) -> object:
    runs = cpu_gemv.ISA_CHOICES.index(name) <= cpu_gemv.ISA_CHOICES.index(cpu_gemv.supported_isa())
    return pytest.param(name, marks=pytest.mark.skipif(not runs, reason=f"this CPU does not run {name}"))


@pytest.fixture(params=[_isa_param(name) for name in ISAS])
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    before = cpu_gemv.isa()
    cpu_gemv.set_isa(request.param)
    try:
        yield request.param
    finally:
        cpu_gemv.set_isa(before)


def _k(name: str) -> int:
    layout = builtin_scheme(name).weight.blocks
    assert layout is not None
    return max(512, 2 * layout.elements)


@functools.cache
def weight_of(name: str, n: int = 37, seed: int = 0) -> CanonicalWeight:
    """Real blocks of a random float32 weight [n, K] (llama.cpp's bytes), canonicalized."""
    scheme = builtin_scheme(name)
    k = _k(name)
    dense = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    raw = quantize_blocks(dense, name.removeprefix("gguf/"))
    return canonical_blocks(scheme, raw, n, k)


@functools.cache
def magnitudes(name: str) -> torch.Tensor:
    """float64 [N, K]: |s_k v_k| + |m_k| of each weight, by the reference decoder."""
    weight = weight_of(name)
    layout = weight.scheme.weight.blocks
    assert layout is not None
    full = decode_blocks(weight.codes, layout).double()
    scaled = decode_blocks(weight.codes, dataclasses.replace(layout, minimum=())).double()
    return scaled.abs() + (scaled - full).abs()


def check_close(name: str, x: torch.Tensor, y: torch.Tensor, expected: torch.Tensor) -> None:
    weight = weight_of(name)
    assert y.shape == expected.shape and y.dtype == expected.dtype == x.dtype
    inputs = x.reshape(-1, weight.k).double().abs()
    bound = 2 * (weight.k + 8) * 2.0**-24 * (inputs @ magnitudes(name).t()).reshape(y.shape)
    if x.dtype != torch.float32:
        ulp = 2.0**-7 if x.dtype == torch.bfloat16 else 2.0**-10  # one unit in the last place
        bound = bound + ulp * torch.maximum(y.double().abs(), expected.double().abs())
    error = (y.double() - expected.double()).abs()
    assert bool((error <= bound + 1e-30).all()), f"{name}: largest excess {float((error - bound).max()):.3e}"


def test_the_declaration_claims_every_quantized_gguf_type() -> None:
    assert EXPECTED <= set(CLAIMED), sorted(EXPECTED - set(CLAIMED))
    assert set(CLAIMED) == set(GGUF) - FLOAT_TYPES  # all 14 quantized types; the float ones are dense
    assert len(CLAIMED) == 14


@pytest.mark.parametrize("name", CLAIMED)
def test_matches_the_reference_kernel(name: str, isa: str) -> None:
    weight = weight_of(name)
    kernel, reference = CpuGemvBlocksKernel(), ReferenceKernel()
    state, expected_state = kernel.prepare(weight, CPU), reference.prepare(weight, CPU)
    generator = torch.Generator().manual_seed(3)
    bias = torch.randn(weight.n, generator=generator)
    for shape, dtype, with_bias, threads in CASES:
        x = torch.randn((*shape, weight.k), generator=generator).to(dtype)
        b = bias.to(dtype) if with_bias else None
        torch.set_num_threads(threads)
        try:
            y = kernel.apply(state, x, b)
        finally:
            torch.set_num_threads(1)
        check_close(name, x, y, reference.apply(expected_state, x, b))


def test_the_scalar_and_vector_loops_agree_within_the_bound() -> None:
    """Every loop computes the same sums in its own order: outputs within the bound of each other too."""
    x = torch.randn(4, _k("gguf/Q4_K"), generator=torch.Generator().manual_seed(5))
    layout = cpu_gemv_blocks.block_layout_of(weight_of("gguf/Q4_K"))
    before = cpu_gemv.isa()
    try:
        outputs = {}
        for name in ISAS[: ISAS.index(cpu_gemv.supported_isa()) + 1]:
            cpu_gemv.set_isa(name)
            outputs[name] = cpu_gemv_blocks.gemv_blocks(layout, x)
    finally:
        cpu_gemv.set_isa(before)
    for y in outputs.values():
        check_close("gguf/Q4_K", x, y, outputs["scalar"])


# The AVX512-BF16 loop's types (written out): the 4-bit types in sub-blocks of 32 read as nibble
# pairs, and the integer codes of 2 to 6 bits in one or two pieces, in sub-blocks of 16 or 32
NIBBLE_PAIR_TYPES = ("gguf/IQ4_NL", "gguf/IQ4_XS", "gguf/MXFP4", "gguf/Q4_0", "gguf/Q4_1", "gguf/Q4_K")
PLANE_TYPES = ("gguf/Q2_K", "gguf/Q3_K", "gguf/Q5_0", "gguf/Q5_1", "gguf/Q5_K", "gguf/Q6_K")
BF16_TYPES = NIBBLE_PAIR_TYPES + PLANE_TYPES
BF16_LOOP = pytest.mark.skipif(
    not cpu_gemv.available()
    or cpu_gemv.supported_isa() != "avx512"
    or cpu_gemv_blocks.dot_loop(cpu_gemv_blocks.block_layout_of(weight_of("gguf/Q4_0"))) is None,
    reason="this CPU has no AVX512-BF16 and VBMI (or QSCHEME_CPU_GEMV_BF16DOT=0): the float32 loops run",
)


@functools.cache
def odd_weight(name: str) -> CanonicalWeight:
    """A weight whose rows hold an odd number of sub-blocks of 32 where its blocks allow it (the
    loop's last pair then half empty), N = 37."""
    scheme = builtin_scheme(name)
    layout = scheme.weight.blocks
    assert layout is not None
    k = 17 * 32 if layout.elements == 32 else 3 * layout.elements
    dense = torch.randn(37, k, generator=torch.Generator().manual_seed(11))
    return canonical_blocks(scheme, quantize_blocks(dense, name.removeprefix("gguf/")), 37, k)


@pytest.mark.parametrize("name", CLAIMED)
def test_the_bf16_loop_takes_its_types(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = cpu_gemv_blocks.block_layout_of(weight_of(name))
    runs = cpu_gemv_blocks.dot_loop(layout)
    if runs is None and name in BF16_TYPES:
        pytest.skip("this CPU has no AVX512-BF16 and VBMI: the float32 loops run")
    assert runs == ("bf16" if name in BF16_TYPES else None)
    monkeypatch.setenv("QSCHEME_CPU_GEMV_BF16DOT", "0")
    assert cpu_gemv_blocks.dot_loop(layout) is None
    before = cpu_gemv.isa()
    try:
        cpu_gemv.set_isa("avx2")
        monkeypatch.delenv("QSCHEME_CPU_GEMV_BF16DOT")
        assert cpu_gemv_blocks.dot_loop(layout) is None  # the AVX2 loops were asked for
    finally:
        cpu_gemv.set_isa(before)


def float_sums(layout: cpu_gemv_blocks.BlockGemvLayout, x: torch.Tensor, threads: int = 1) -> torch.Tensor:
    """The extension's float32 sums for bfloat16 rows of x (its output not rounded to bfloat16)."""
    out = torch.empty(x.shape[0], layout.n, dtype=torch.float32)
    c, (n, k, row_bytes, tables) = layout.compiled, layout.meta
    cpu_gemv.native().gemv_blocks(
        x.data_ptr(), 1, x.shape[0], out.data_ptr(), 0, 0, threads, layout.codes.data_ptr(), n, k, row_bytes,
        c.program.data_ptr(), c.program.numel(), c.values.data_ptr(), c.byte_tables.data_ptr(), tables,
    )  # fmt: skip
    return out


@BF16_LOOP
@pytest.mark.parametrize("name", BF16_TYPES)
def test_the_bf16_loop_matches_the_reference_kernel(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both loops on the same inputs (their float32 sums), an odd number of sub-blocks per row, M = 1
    to 6 (two passes), ragged N, 1 and 2 threads: each within the bound of the reference's float32
    result; and through the op with a bias, within it plus one bfloat16 rounding."""
    check_bf16_loop(name, monkeypatch)


# the nibble-pair types whose 16 code values are small integers (MXFP4's are halves): the integer products
INTEGER_TYPES = ("gguf/IQ4_NL", "gguf/IQ4_XS", "gguf/Q4_0", "gguf/Q4_1", "gguf/Q4_K")


@BF16_LOOP
@pytest.mark.parametrize("name", NIBBLE_PAIR_TYPES)
def test_the_integer_products_match_the_reference_kernel(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """QSCHEME_CPU_GEMV_GGUF_INT16=1 (the default on AMX CPUs): at M <= 2 the 4-bit codes with integer
    values multiply x rounded to 16-bit integers per block of 256 (VPDPWSSD), within the reference's bound
    plus that rounding; the rows of x beyond 2, and MXFP4, keep the bfloat16 products."""
    check_bf16_loop(name, monkeypatch, integer="1")


@BF16_LOOP
@pytest.mark.parametrize("name", PLANE_TYPES)
def test_the_integer_codes_take_64_or_32_elements_a_step(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The K-quants' pieces lie in runs of 32 bytes: 64 elements a step; Q5_0 and Q5_1 (blocks of 32)
    take 32. QSCHEME_CPU_GEMV_PLANES64=0 (read at each call) sends every layout to 32 a step, which
    then matches the reference kernel as the 64-element steps do."""
    layout = cpu_gemv_blocks.block_layout_of(odd_weight(name))
    blocks = builtin_scheme(name).weight.blocks
    assert blocks is not None
    assert cpu_gemv_blocks.plane_step(layout) == (64 if blocks.elements == 256 else 32)
    monkeypatch.setenv("QSCHEME_CPU_GEMV_PLANES64", "0")
    assert cpu_gemv_blocks.plane_step(layout) == 32
    check_bf16_loop(name, monkeypatch)  # ends with QSCHEME_CPU_GEMV_BF16DOT=0
    monkeypatch.delenv("QSCHEME_CPU_GEMV_BF16DOT")
    monkeypatch.delenv("QSCHEME_CPU_GEMV_PLANES64")
    assert cpu_gemv_blocks.plane_step(layout) == (64 if blocks.elements == 256 else 32)


@pytest.mark.parametrize("name", NIBBLE_PAIR_TYPES)
def test_the_nibble_pair_types_have_no_plane_step(name: str) -> None:
    assert cpu_gemv_blocks.plane_step(cpu_gemv_blocks.block_layout_of(weight_of(name))) is None


def x_rounding(x: torch.Tensor) -> torch.Tensor:
    """float64 [M, K]: half the step of the integer products' rounding of each element of x (rows of
    bfloat16), the step of a block of 256 elements the power of two 2**(e - 15), its largest magnitude
    f * 2**e with 0.5 <= f < 1 (zero where the block is all zeros)."""
    m, k = x.shape
    padded = torch.zeros(m, -(-k // 256) * 256, dtype=torch.float64)
    padded[:, :k] = x.double().abs()
    largest = padded.reshape(m, -1, 256).amax(dim=2)
    _, exponent = torch.frexp(largest)
    half_step = torch.where(largest > 0, torch.ldexp(torch.full_like(largest, 0.5), exponent - 15), 0.0)
    return half_step.repeat_interleave(256, dim=1)[:, :k]


def check_bf16_loop(name: str, monkeypatch: pytest.MonkeyPatch, integer: str = "0") -> None:
    """The loop against the reference; ``integer`` sets QSCHEME_CPU_GEMV_GGUF_INT16: "1" adds x's
    rounding to 16-bit integers to the bound at M <= 2 (the integer products' rows), and checks that they
    ran there (the sums differ from the bfloat16 products') for the types whose code values are integers."""
    monkeypatch.setenv("QSCHEME_CPU_GEMV_GGUF_INT16", integer)
    weight = odd_weight(name)
    layout = cpu_gemv_blocks.block_layout_of(weight)
    assert cpu_gemv_blocks.dot_loop(layout) == "bf16"
    reference = ReferenceKernel()
    state = reference.prepare(weight, CPU)
    generator = torch.Generator().manual_seed(7)
    bias = torch.randn(weight.n, generator=generator).to(BF16)
    # |s_k v_k| + |m_k| of this weight, for the bound
    blocks = weight.scheme.weight.blocks
    assert blocks is not None
    full = decode_blocks(weight.codes, blocks).double()
    scaled = decode_blocks(weight.codes, dataclasses.replace(blocks, minimum=())).double()
    size = scaled.abs() + (scaled - full).abs()
    for m in (1, 2, 3, 4, 6):
        x = (torch.randn(m, weight.k, generator=generator) * 4).to(BF16)
        expected = reference.apply(state, x.float(), None).double()
        bound = 2 * (weight.k + 8) * 2.0**-24 * (x.double().abs() @ size.t())
        if integer == "1" and m <= 2:
            bound = bound + x_rounding(x) @ size.t()
        sums = {}
        for flag in ("1", "0"):
            monkeypatch.setenv("QSCHEME_CPU_GEMV_BF16DOT", flag)
            sums[flag] = float_sums(layout, x, threads=1 + m % 2).double()
            assert bool(((sums[flag] - expected).abs() <= bound + 1e-30).all()), (name, flag, m)
        if integer == "1" and name in INTEGER_TYPES:  # the integer products ran at M <= 2, not beyond
            monkeypatch.setenv("QSCHEME_CPU_GEMV_BF16DOT", "1")
            monkeypatch.setenv("QSCHEME_CPU_GEMV_GGUF_INT16", "0")
            products = float_sums(layout, x, threads=1 + m % 2).double()
            monkeypatch.setenv("QSCHEME_CPU_GEMV_GGUF_INT16", "1")
            monkeypatch.setenv("QSCHEME_CPU_GEMV_BF16DOT", "0")
            assert torch.equal(products, sums["1"]) == (m > 2), (name, m)
            y = cpu_gemv_blocks.gemv_blocks(layout, x, bias).double()
            with_bias = reference.apply(state, x, bias).double()
            ulp = 2.0**-7 * torch.maximum(y.abs(), with_bias.abs())
            assert bool(((y - with_bias).abs() <= bound + ulp + 1e-30).all()), (name, flag, m)
        assert cpu_gemv_blocks.dot_loop(layout) is None  # the switch is read at each call


VNNI = pytest.mark.skipif(
    not cpu_gemv.available() or cpu_gemv.supported_isa() != "avx512" or "avx512_vnni" not in cpu_flags(),
    reason="this CPU has no AVX512-VNNI (or the AVX-512 loops do not run): the integer products are off",
)


@BF16_LOOP
@VNNI
def test_q4_k_integer_products_take_128_elements_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Q4_K's units of two sub-blocks lie two by two in 64 bytes: its integer products take 128 elements
    a step (QSCHEME_CPU_GEMV_GGUF_WIDE, read at each call; 0 sends them to the pairs' loop). Both loops
    match the reference kernel within the bound, and they are two loops: their float32 sums differ."""
    monkeypatch.setenv("QSCHEME_CPU_GEMV_GGUF_INT16", "1")
    monkeypatch.setenv("QSCHEME_CPU_GEMV_BF16DOT", "1")
    layout = cpu_gemv_blocks.block_layout_of(odd_weight("gguf/Q4_K"))
    x = (torch.randn(2, layout.k, generator=torch.Generator().manual_seed(11)) * 4).to(BF16)
    sums = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("QSCHEME_CPU_GEMV_GGUF_WIDE", flag)
        sums[flag] = float_sums(layout, x)
    assert not torch.equal(sums["1"], sums["0"])
    check_bf16_loop("gguf/Q4_K", monkeypatch, integer="1")  # with the pairs' loop (the switch at 0)
    monkeypatch.delenv("QSCHEME_CPU_GEMV_GGUF_WIDE")
    monkeypatch.delenv("QSCHEME_CPU_GEMV_BF16DOT")  # check_bf16_loop ends with it at 0
    check_bf16_loop("gguf/Q4_K", monkeypatch, integer="1")


@VNNI
def test_byte_blocks_take_integer_products_at_one_or_two_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Q8_0 (signed byte codes, one fp16 scale a block) with QSCHEME_CPU_GEMV_GGUF_INT16=1: one or two
    bfloat16 rows of x are rounded to 16-bit integers per block of 256 and multiplied with VPMADDWD,
    within the reference's float32 bound plus x's rounding (K of 17 blocks: a last block of 256 part
    full; M = 1 and 2 on 1 and 2 threads); they ran there (the sums differ from the float32 loop's) and
    not at M = 3; an element of x out of [2**-100, 2**64] sends the call to the float32 loop, bit for bit;
    through the op with a bias, within the bound plus one bfloat16 rounding."""
    weight = odd_weight("gguf/Q8_0")
    layout = cpu_gemv_blocks.block_layout_of(weight)
    reference = ReferenceKernel()
    state = reference.prepare(weight, CPU)
    blocks = weight.scheme.weight.blocks
    assert blocks is not None
    size = decode_blocks(weight.codes, blocks).double().abs()
    generator = torch.Generator().manual_seed(5)
    bias = torch.randn(weight.n, generator=generator).to(BF16)
    for m in (1, 2, 3):
        x = (torch.randn(m, weight.k, generator=generator) * 4).to(BF16)
        x[0, :256] *= 2.0**-12  # a block of small elements: its own step
        expected = reference.apply(state, x.float(), None).double()
        bound = 2 * (weight.k + 8) * 2.0**-24 * (x.double().abs() @ size.t())
        sums = {}
        for flag in ("0", "1"):
            monkeypatch.setenv("QSCHEME_CPU_GEMV_GGUF_INT16", flag)
            sums[flag] = float_sums(layout, x, threads=1 + m % 2).double()
            limit = bound + (x_rounding(x) @ size.t() if flag == "1" and m <= 2 else 0.0)
            assert bool(((sums[flag] - expected).abs() <= limit + 1e-30).all()), (flag, m)
        assert torch.equal(sums["0"], sums["1"]) == (m > 2), m
        if m <= 2:
            y = cpu_gemv_blocks.gemv_blocks(layout, x, bias).double()
            with_bias = reference.apply(state, x, bias).double()
            ulp = 2.0**-7 * torch.maximum(y.abs(), with_bias.abs())
            limit = bound + x_rounding(x) @ size.t() + ulp
            assert bool(((y - with_bias).abs() <= limit + 1e-30).all()), m
            odd = x.clone()
            odd[m - 1, weight.k - 1] = 2.0**70
            monkeypatch.setenv("QSCHEME_CPU_GEMV_GGUF_INT16", "0")
            floats = float_sums(layout, odd)
            monkeypatch.setenv("QSCHEME_CPU_GEMV_GGUF_INT16", "1")
            assert torch.equal(float_sums(layout, odd), floats), m


@BF16_LOOP
@pytest.mark.parametrize("name", ("gguf/Q4_0", "gguf/IQ4_XS", "gguf/Q4_K", "gguf/Q6_K", "gguf/Q5_0"))
def test_each_row_lands_in_its_place_over_streams_and_spans(name: str) -> None:
    """The loop reads a worker's rows as 4 (M <= 2) or 2 streams, each a quarter or half of its span,
    the rest one at a time. A row's sums do not depend on which stream or worker read it: a tall
    weight of one 37-row slab repeated (259 rows: two workers' spans, streams of 31-33 rows and a
    remainder) gives, bit for bit, the slab's own sums in every copy, on 1 and 2 threads."""
    slab = odd_weight(name)
    tall = canonical_blocks(slab.scheme, slab.codes.repeat(7, 1), 7 * slab.n, slab.k)
    generator = torch.Generator().manual_seed(3)
    for m in (1, 3):
        x = torch.randn(m, slab.k, generator=generator).to(BF16)
        own = float_sums(cpu_gemv_blocks.block_layout_of(slab), x)
        for threads in (1, 2):
            sums = float_sums(cpu_gemv_blocks.block_layout_of(tall), x, threads)
            assert torch.equal(sums, own.repeat(1, 7)), (name, m, threads)


# bfloat16 values at the edges of the loop's range: (value, whether the loop takes it)
EDGES = (
    (2.0**-110, False),
    (-(2.0**70), False),
    (2.0**-100, True),  # the smallest magnitude taken
    (-(2.0**-101) * (2 - 2**-7), False),  # the largest bfloat16 below it
    (2.0**64, True),  # the largest taken
    (2.0**64 * (1 + 2**-7), False),  # the next bfloat16 up
    (-0.0, True),
    (2.0**-130, False),  # subnormal in bfloat16
    (float("inf"), False),
)


@BF16_LOOP
@pytest.mark.parametrize(("value", "inside"), EDGES)
def test_inputs_out_of_the_bf16_loops_range_take_the_float_loops(
    value: float, inside: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An element of x below 2**-100 or above 2**64 in magnitude (VDPBF16PS would flush or overflow
    there), or not finite: the call runs the float32 loops, bit for bit what they give with the loop
    switched off. Zero and the range's own ends stay on the loop (its sums differ in the last bits)."""
    weight = odd_weight("gguf/Q4_0")
    layout = cpu_gemv_blocks.block_layout_of(weight)
    x = torch.randn(2, weight.k, generator=torch.Generator().manual_seed(3)).to(BF16)
    for row, column in ((1, 5), (0, weight.k - 1)):  # a row of the last, half pair
        odd = x.clone()
        odd[row, column] = value
        assert float(odd[row, column]) == value  # exactly a bfloat16 value
        y = float_sums(layout, odd)
        monkeypatch.setenv("QSCHEME_CPU_GEMV_BF16DOT", "0")
        floats = float_sums(layout, odd)
        monkeypatch.delenv("QSCHEME_CPU_GEMV_BF16DOT")
        same_bits = torch.equal(y.view(torch.int32), floats.view(torch.int32))  # NaN where x holds inf
        assert same_bits != inside, (value, row, column)


def test_a_program_is_matched_by_its_contents_not_its_address() -> None:
    """The extension keeps each program it has parsed; a call whose program or value table holds
    other numbers at the same address (a tensor changed in place, or freed and its memory reused)
    is parsed anew, never served the kept one. Doubling every code value doubles every sum exactly."""
    weight = weight_of("gguf/Q4_0", 64, 1)
    layout = cpu_gemv_blocks.block_layout_of(weight)
    compiled = layout.compiled
    own = dataclasses.replace(compiled, program=compiled.program.clone(), values=compiled.values.clone())
    mine = dataclasses.replace(layout, compiled=own)
    x = torch.randn(3, weight.k, generator=torch.Generator().manual_seed(4)).to(BF16)
    before = float_sums(mine, x)
    address = own.values.data_ptr()
    own.values.mul_(2)
    assert own.values.data_ptr() == address
    assert torch.equal(float_sums(mine, x), 2 * before)
    own.values.div_(2)
    assert torch.equal(float_sums(mine, x), before)
    own.program[3] = 9  # n_scale beyond the extension's limit: refused, not served from the kept entry
    with pytest.raises(ValueError, match="inconsistent block program"):
        float_sums(mine, x)


def test_the_state_is_the_canonical_blocks() -> None:
    first, second = weight_of("gguf/Q4_K"), weight_of("gguf/Q4_K", 64, 1)
    states = [CpuGemvBlocksKernel().prepare(w, CPU).layout for w in (first, second)]
    for weight, layout in zip((first, second), states, strict=True):
        assert layout.codes.untyped_storage().data_ptr() == weight.codes.untyped_storage().data_ptr()
    assert states[0].compiled is states[1].compiled  # one program per scheme, shared by its layers
    program = sum(t.numel() * t.element_size() for key, t in states[0].tensors().items() if key != "codes")
    assert program < 8 << 10  # bytes, once per scheme: a 4096 x 4096 Q4_K layer holds 9.4 MB of blocks


@pytest.mark.parametrize("bf16_loop", [True, False])
def test_the_resolver_plans_it_for_small_batches(bf16_loop: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """For M <= 15 on a CPU (M <= 4 where the blocks' fused GEMM takes bfloat16 inputs from M = 5). With
    bfloat16 inputs on a CPU running the AVX512-BF16 loop (the check's answer set either way here), the
    4-bit types in sub-blocks of 32 go to cpu_gemv_blocks_bf16 (62); on other CPUs the affine ones stay on
    tinygemm_cpu (60, faster than the float32 loops in the benchmark's same runs). With float32 inputs,
    which neither takes, they all come here."""
    monkeypatch.setattr(cpu_gemv_blocks, "bf16_loop_available", lambda: bf16_loop)
    monkeypatch.setattr(cpu_gemv_blocks, "gemm_available", lambda: bf16_loop)  # the same CPUs (AVX512-BF16)
    # multiplying with VDPBF16PS (on the AMX tiles its range starts at M = 4 for every type)
    monkeypatch.setattr(cpu_gemv_blocks, "gemm_loops", lambda: "avx512" if bf16_loop else None)
    # and the tile GEMM's VDPBF16PS loops, under which tinygemm_cpu's range stops at M = 4
    monkeypatch.setattr(tile_gemm, "isa", lambda: "avx512" if bf16_loop else "scalar")
    device = fake_device("cpu", modules=all_modules() | {CPU_GEMV_BLOCKS.implementation_module or ""})
    declarations = registry.declarations()
    for name in CLAIMED:
        for dtype in ("bfloat16", "float32"):
            resolution = resolve(builtin_scheme(name), Problem(4096, 4096, dtype), device, declarations)
            expected = "cpu_gemv_blocks"
            if dtype == "bfloat16" and bf16_loop and name in BF16_TYPES:
                expected = "cpu_gemv_blocks_bf16"
            elif dtype == "bfloat16" and name in TINYGEMM_TYPES:
                expected = "tinygemm_cpu"
            assert resolution.kernel is not None and resolution.kernel.name == expected, (name, dtype)
            # with bfloat16 inputs on AVX512-BF16 CPUs the blocks' fused GEMM takes M >= 5 (>= 4 for blocks of
            # 8 bits a weight and more: Q8_0)
            wide = builtin_scheme(name).weight.blocks.bits_per_weight >= 8  # type: ignore[union-attr]
            last = (3 if wide else 4) if dtype == "bfloat16" and bf16_loop else 15
            assert resolution.plan.kernel_for(last).name == expected
            large = resolution.plan.kernel_for(last + 1).name
            assert large == ("cpu_gemm_blocks" if last < 15 else "dequant_gemm"), (name, dtype)
    resolution = resolve(builtin_scheme("gguf/F16"), Problem(4096, 4096), device, declarations)
    assert resolution.kernel is not None and resolution.kernel.name != "cpu_gemv_blocks"


def test_quant_linear_runs_it() -> None:
    weight = weight_of("gguf/Q6_K")
    bias = torch.randn(weight.n)
    layer = QuantLinear.from_canonical(weight, kernel="cpu_gemv_blocks", bias=bias)
    x = torch.randn(2, 3, weight.k).to(torch.bfloat16)
    expected = QuantLinear.from_canonical(weight, kernel="reference", bias=bias)(x)
    check_close("gguf/Q6_K", x, layer(x), expected)


def test_the_extension_check_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    problem = Problem(64, 256)
    assert NativeBlockLoops().check(problem).ok == (cpu_gemv.supported_isa() != "scalar")

    def missing(name: str) -> object:
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr("qscheme_plugins.cpu_gemv_blocks.importlib.import_module", missing)
    result = NativeBlockLoops().check(problem)
    assert not result.ok and "qscheme._cpu_gemv is not built" in result.reason and "C++17" in result.hint


def test_the_bf16_loop_check_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    problem = Problem(64, 256)
    assert Bf16BlockLoop().check(problem).ok == cpu_gemv_blocks.bf16_loop_available()
    monkeypatch.setenv("QSCHEME_CPU_GEMV_BF16DOT", "0")
    assert not cpu_gemv_blocks.bf16_loop_available()
    result = Bf16BlockLoop().check(problem)
    assert not result.ok and "AVX512-BF16 and VBMI" in result.reason and "tinygemm_cpu" in result.hint


def test_refusals_are_typed() -> None:
    with pytest.raises(UsageError, match="plain float blocks"):
        cpu_gemv_blocks.block_layout_of(
            canonical_blocks(builtin_scheme("gguf/F16"), torch.zeros(4, 64, dtype=torch.uint8), 4, 32)
        )
    with pytest.raises(UsageError, match="takes packed blocks"):
        cpu_gemv_blocks.block_layout_of(
            CanonicalWeight(
                builtin_scheme("compressed-tensors/W8A16_G32"),
                2,
                32,
                torch.zeros(2, 32, dtype=torch.int8),
                torch.ones(2, 1),
            )
        )
    layout = cpu_gemv_blocks.block_layout_of(weight_of("gguf/Q4_0"))
    with pytest.raises(UsageError, match=r"\[M, 512\]"):
        cpu_gemv_blocks.gemv_blocks(layout, torch.randn(2, 511))
    state = CpuGemvBlocksKernel().prepare(weight_of("gguf/Q4_0"), CPU)
    with pytest.raises(UsageError, match="K=512"):
        CpuGemvBlocksKernel().apply(state, torch.randn(3, 256), None)


def test_the_op_has_a_fake_implementation() -> None:
    layout = cpu_gemv_blocks.block_layout_of(weight_of("gguf/IQ4_NL"))
    c = layout.compiled
    x = torch.randn(2, layout.k).to(torch.bfloat16)
    torch.library.opcheck(
        torch.ops.qscheme.cpu_gemv_blocks.default,
        (x, layout.codes, c.program, c.values, c.byte_tables, torch.randn(layout.n), list(layout.meta), 1),
        test_utils=("test_schema", "test_faketensor"),
    )
    compiled = torch.compile(lambda v: cpu_gemv_blocks.gemv_blocks(layout, v), fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), cpu_gemv_blocks.gemv_blocks(layout, x))


@pytest.mark.parametrize("name", CLAIMED)
def test_the_block_decoder_is_the_reference_decoder(name: str) -> None:
    """cpu_gemv_blocks.dequantize_rows (the AVX-512 decoder dequant_gemm's tiles use): bit for bit
    decode_blocks in float32, and those values rounded once to bfloat16, for row ranges, ragged N,
    1 and 2 threads; None where the AVX-512 loops do not run (then dequant_gemm decodes with torch)."""
    weight = odd_weight(name)
    layout = cpu_gemv_blocks.block_layout_of(weight)
    blocks = weight.scheme.weight.blocks
    assert blocks is not None
    expected = decode_blocks(weight.codes, blocks)
    runs = cpu_gemv.available() and cpu_gemv.isa() == "avx512"
    for start, stop, threads in ((0, weight.n, 2), (5, 22, 1), (36, 37, 2), (9, 9, 1)):
        rows = cpu_gemv_blocks.dequantize_rows(layout, start, stop, torch.float32, threads)
        halves = cpu_gemv_blocks.dequantize_rows(layout, start, stop, torch.bfloat16, threads)
        if not runs and stop > start:
            assert rows is None and halves is None
            continue
        assert rows is not None and halves is not None
        assert rows.dtype == torch.float32 and halves.dtype == torch.bfloat16
        assert torch.equal(rows.view(torch.int32), expected[start:stop].view(torch.int32))
        assert torch.equal(halves.view(torch.int16), expected[start:stop].to(torch.bfloat16).view(torch.int16))
    with pytest.raises(UsageError, match="not within N"):
        cpu_gemv_blocks.dequantize_rows(layout, 3, weight.n + 1)
    with pytest.raises(UsageError, match="float32 or bfloat16"):
        cpu_gemv_blocks.dequantize_rows(layout, 0, 1, torch.float16)


def test_the_block_decoder_rounds_to_bfloat16_as_torch_does() -> None:
    """Halfway cases (ties to even, both ways), the largest fp16 scale, an fp16 subnormal one, a
    negative and a zero one (a file's scales are finite: canonical_blocks refuses inf and NaN): Q8_0
    blocks times codes +-1, +-127, 0, 3 and 5, against decode_blocks(...).to(bfloat16)."""
    if not (cpu_gemv.available() and cpu_gemv.isa() == "avx512"):
        pytest.skip("the AVX-512 loops do not run here")
    scheme = builtin_scheme("gguf/Q8_0")
    blocks = scheme.weight.blocks
    assert blocks is not None
    scales = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 65504.0, 2**-24, -(1 + 2**-8), 0.0])
    raw = torch.zeros(len(scales), 34, dtype=torch.uint8)
    raw[:, :2] = scales.to(torch.float16).view(torch.uint8).reshape(-1, 2)
    raw[:, 2:] = torch.tensor([1, -1, 127, -127, 0] * 6 + [3, 5], dtype=torch.int8).view(torch.uint8)
    weight = canonical_blocks(scheme, raw, len(scales), 32)
    layout = cpu_gemv_blocks.block_layout_of(weight)
    expected = decode_blocks(raw, blocks)
    halves = cpu_gemv_blocks.dequantize_rows(layout, 0, len(scales), torch.bfloat16)
    assert halves is not None
    assert torch.equal(halves.view(torch.int16), expected.to(torch.bfloat16).view(torch.int16))
    rows = cpu_gemv_blocks.dequantize_rows(layout, 0, len(scales))
    assert rows is not None and torch.equal(rows.view(torch.int32), expected.view(torch.int32))
