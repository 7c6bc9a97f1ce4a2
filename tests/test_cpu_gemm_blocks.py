"""``cpu_gemv_blocks.gemm``: the fused GEMM over packed blocks (qscheme._cpu_gemv.gemm_blocks, C++),
dequant_gemm's prefill kernel for GGUF's types on CPUs with AVX512-BF16.

Every GGUF type the blocks' kernels claim, as real GGUF blocks (qscheme's GGUF quantizer, bit for
bit llama.cpp's: tests/test_gguf_quants.py):

- the panel: multiplied by the identity, the output is each weight of the reference decoder
  (``decode_blocks``) rounded once to bfloat16, bit for bit (a float32 subnormal weight is zero, as
  the instruction reads a bfloat16 subnormal), for ragged N (37 rows: a 5-row last panel), rows
  with an odd number of sub-blocks of 32, output column ranges that do not start on a panel, K
  in one chunk and in chunks of one block, 1 and 2 threads;
- the sums: random inputs (M = 1, 5, 37, 100), bias, into a view of a wider output, within half a
  bfloat16 unit of the exact product of the rounded weight plus K float32 roundings;
- both multiplies, each where it runs: VDPBF16PS (``QSCHEME_CPU_GEMM_BLOCKS_AMX=0``) and the AMX
  tiles (the default where ``gemm_loops`` says "amx");
- where it runs (``gemm_runs``: AVX512-BF16, VBMI and the AVX-512 loops in use), typed refusals, the op's
  fake implementation (opcheck, torch.compile);
- the ``cpu_gemm_blocks`` kernel: the plan's kernel from M = 4 or 5 for bfloat16 inputs where it runs
  (rejected with its reason elsewhere, never for float32 inputs), a QuantLinear running it with no
  copy of the blocks, and its refusals.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from kernel_fakes import builtin_scheme, builtin_schemes, isolated_plugins
from qscheme_plugins.cpu_gemv_blocks import CPU_GEMM_BLOCKS
from qscheme_plugins.cpu_gemv_blocks_kernel import CpuGemmBlocksKernel

from qscheme import cpu_gemv, cpu_gemv_blocks
from qscheme.canonical import CanonicalWeight
from qscheme.canonical_blocks import canonical_blocks
from qscheme.descriptor import parse_scheme_text
from qscheme.errors import UsageError
from qscheme.formats.blocks import decode_blocks
from qscheme.kernels import registry
from qscheme.modules import QuantLinear, problem_for
from qscheme.producers.gguf.quants.api import quantize_blocks

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
kernel_table = importlib.import_module("kernel_table")

pytestmark = pytest.mark.skipif(
    not cpu_gemv.available() or not hasattr(cpu_gemv.native(), "gemm_blocks"),
    reason="qscheme._cpu_gemv (with gemm_blocks) is not built",
)

FLOAT_TYPES = {"gguf/F32", "gguf/F16", "gguf/BF16"}
CODED = sorted(s.name for s in builtin_schemes() if s.name.startswith("gguf/") and s.name not in FLOAT_TYPES)


def weight_of(name: str, n: int = 37, seed: int = 11) -> CanonicalWeight:
    """Real blocks of a random weight [n, K], K an odd number of sub-blocks of 32 where the blocks allow."""
    scheme = builtin_scheme(name)
    layout = scheme.weight.blocks
    assert layout is not None
    k = 17 * 32 if layout.elements == 32 else 3 * layout.elements
    dense = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    return canonical_blocks(scheme, quantize_blocks(dense, name.removeprefix("gguf/")), n, k)


def runs_here() -> bool:
    return cpu_gemv_blocks.gemm_runs(cpu_gemv_blocks.block_layout_of(weight_of("gguf/Q4_0", 4)))


GEMM = pytest.mark.skipif(
    not cpu_gemv.available() or cpu_gemv.supported_isa() != "avx512" or not runs_here(),
    reason="this CPU has no AVX512-BF16 (or the AVX-512 loops do not run): dequant_gemm decodes tiles instead",
)


@pytest.fixture(params=["vdpbf16ps", "amx"])
def multiply(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The fused GEMM's multiply: VDPBF16PS (the AMX tiles switched off), or the AMX tiles where they run."""
    monkeypatch.delenv("QSCHEME_CPU_GEMM_BLOCKS_AMX", raising=False)
    if request.param == "amx":
        if cpu_gemv_blocks.gemm_loops() != "amx":
            pytest.skip("this CPU has no AMX-BF16 (or the tile state was not granted): the panels use VDPBF16PS")
        return "amx"
    monkeypatch.setenv("QSCHEME_CPU_GEMM_BLOCKS_AMX", "0")
    assert cpu_gemv_blocks.gemm_loops() == "avx512"
    return "avx512"


@pytest.fixture
def isa_restored() -> Iterator[None]:
    before = cpu_gemv.isa()
    yield
    cpu_gemv.set_isa(before)


def rounded(weight: CanonicalWeight) -> torch.Tensor:
    """The reference weight rounded once to bfloat16, a float32 subnormal as zero."""
    blocks = weight.scheme.weight.blocks
    assert blocks is not None
    exact = decode_blocks(weight.codes, blocks)
    return torch.where(exact.abs() < 2.0**-126, torch.zeros_like(exact), exact).to(torch.bfloat16)


@GEMM
@pytest.mark.parametrize("name", CODED)
def test_the_panel_is_the_reference_weight_rounded_once(
    name: str, multiply: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    weight = weight_of(name)
    layout = cpu_gemv_blocks.block_layout_of(weight)
    expected = rounded(weight).float()
    identity = torch.eye(weight.k).to(torch.bfloat16)
    blocks = weight.scheme.weight.blocks
    assert blocks is not None
    for chunk in (cpu_gemv_blocks.GEMM_CHUNK, blocks.elements):
        monkeypatch.setattr(cpu_gemv_blocks, "GEMM_CHUNK", chunk)
        for start, stop, threads in ((0, weight.n, 2), (5, 30, 1), (36, 37, 2)):
            y = cpu_gemv_blocks.gemm(layout, identity, None, start, stop, threads)
            assert y.dtype == torch.bfloat16 and y.shape == (weight.k, stop - start)
            assert torch.equal(y.float().T, expected[start:stop]), (name, multiply, start, stop, chunk)


@GEMM
@pytest.mark.parametrize(
    ("name", "decoder"),
    [("gguf/Q3_K", "runs64"), ("gguf/Q5_K", "runs64"), ("gguf/Q6_K", "runs64"), ("gguf/Q5_0", "runs"),
     ("gguf/Q5_1", "runs"), ("gguf/Q8_0", "elements"), ("gguf/Q4_K", "words"), ("gguf/Q2_K", "words")],
)  # fmt: skip
def test_each_layout_takes_the_decoder_it_fits(name: str, decoder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Codes of two or three pieces whose every piece lies in runs of 64 or 32 bytes (the K-quants Q3_K,
    Q5_K, Q6_K) decode 64 elements a step; Q5_0's and Q5_1's fifth bits are single bits (the runs'
    decoder, 32 a step); 4-bit codes of one piece are looked up as words. QSCHEME_CPU_GEMM_BLOCKS_RUN64=0
    (read at each call) sends the runs of 64 to the runs' decoder; each decoder gives the reference
    weight rounded once."""
    weight = weight_of(name)
    layout = cpu_gemv_blocks.block_layout_of(weight)
    expected = rounded(weight).float()
    identity = torch.eye(weight.k).to(torch.bfloat16)
    monkeypatch.delenv("QSCHEME_CPU_GEMM_BLOCKS_RUN64", raising=False)
    assert cpu_gemv_blocks.gemm_decoder(layout) == decoder
    monkeypatch.setenv("QSCHEME_CPU_GEMM_BLOCKS_RUN64", "0")
    assert cpu_gemv_blocks.gemm_decoder(layout) == ("runs" if decoder == "runs64" else decoder)
    for flag in ("0", "1"):
        monkeypatch.setenv("QSCHEME_CPU_GEMM_BLOCKS_RUN64", flag)
        y = cpu_gemv_blocks.gemm(layout, identity, None, 0, weight.n, 2)
        assert torch.equal(y.float().T, expected), (name, flag)


SIGNED_RUNS = """
name: gguf/TEST_SIGNED_RUNS
producer: gguf
weight:
  packing: blocks
  tensor: {name: weight, dtype: uint8, shape: [N, "K/256*210"]}
  blocks:
    elements: 256
    bytes: 210
    fields:
      - {name: ql, bytes: 128}
      - {name: qh, bytes: 64}
      - {name: scales, bytes: 16}
      - {name: d, format: fp16}
    integers:
      sc: {count: 16, planes: [{field: scales, bits: 8}], signed: true}
      q: {count: 256, planes: PLANES, OFFSET}
    element: {integer: q}
    scale: [d, sc]
activation: none
"""


LOW_FIRST = "[{field: ql, bits: 4, run: 64}, {field: qh, bits: 2, run: 32}]"  # Q6_K's
HIGH_FIRST = "[{field: qh, bits: 2, run: 32}, {field: ql, bits: 4, run: 64}]"  # the run of 64 second


@GEMM
@pytest.mark.parametrize(
    ("planes", "codes"),
    [(LOW_FIRST, "signed: true"), (LOW_FIRST, "offset: -60"), (LOW_FIRST, "offset: 60"), (HIGH_FIRST, "offset: -32")],
)
def test_runs_of_64_form_signed_and_offset_codes_as_bytes(planes: str, codes: str) -> None:
    """YAML-only layouts of Q6_K's pieces, in its order or with the run of 64 bytes as the second piece,
    with signed 6-bit codes or an offset that leaves every value within a signed byte, decode 64 elements
    a step and give the reference weight rounded once (random bytes for the codes and scales)."""
    scheme = parse_scheme_text(SIGNED_RUNS.replace("PLANES", planes).replace("OFFSET", codes), "<test>")
    n, k = 33, 3 * 256
    raw = torch.randint(0, 256, (n, k // 256, 210), generator=torch.Generator().manual_seed(4), dtype=torch.uint8)
    raw[:, :, 208:] = torch.tensor([0x00, 0x1C], dtype=torch.uint8)  # d = 2**-8 in every block
    weight = canonical_blocks(scheme, raw.reshape(n, -1), n, k)
    layout = cpu_gemv_blocks.block_layout_of(weight)
    assert cpu_gemv_blocks.gemm_decoder(layout) == "runs64"
    y = cpu_gemv_blocks.gemm(layout, torch.eye(k).to(torch.bfloat16), None, 0, n, 2)
    assert torch.equal(y.float().T, rounded(weight).float())


@GEMM
@pytest.mark.parametrize("name", ["gguf/Q4_0", "gguf/Q4_1", "gguf/Q4_K", "gguf/Q2_K", "gguf/Q6_K", "gguf/Q8_0"])
def test_the_sums_are_within_their_bound(name: str, multiply: str) -> None:
    weight = weight_of(name)
    layout = cpu_gemv_blocks.block_layout_of(weight)
    w = rounded(weight).double()
    generator = torch.Generator().manual_seed(3)
    bias = torch.randn(weight.n, generator=generator)
    # 100: on VDPBF16PS six blocks of 16 rows as pairs, four by the dot blocks; on the tiles seven blocks of 16
    # (the last of four rows), in four pairs of blocks (the last a single one)
    for m in (1, 5, 37, 100):
        x = torch.randn(m, weight.k, generator=generator).to(torch.bfloat16)
        wide = torch.full((m, weight.n + 8), 7.0, dtype=torch.bfloat16)
        out = wide[:, 4 : 4 + weight.n - 10]
        y = cpu_gemv_blocks.gemm(layout, x, bias, 10, weight.n, threads=2, out=out)
        assert y.data_ptr() == out.data_ptr()
        # nothing else written
        assert bool((wide[:, :4] == 7).all()) and bool((wide[:, 4 + weight.n - 10 :] == 7).all())
        exact = x.double() @ w[10:].T + bias.double()[10:]
        magnitude = x.double().abs() @ w[10:].abs().T + bias.double()[10:].abs()
        bound = 2.0**-8 * exact.abs() + (weight.k + 2) * 2.0**-24 * magnitude + 1e-30
        assert bool(((y.double() - exact).abs() <= bound).all()), (name, multiply, m)
    empty = cpu_gemv_blocks.gemm(layout, torch.zeros(0, weight.k, dtype=torch.bfloat16))
    assert empty.shape == (0, weight.n)


def test_it_runs_where_avx512_bf16_runs(isa_restored: None) -> None:
    layout = cpu_gemv_blocks.block_layout_of(weight_of("gguf/Q4_K"))
    x = torch.randn(3, layout.k).to(torch.bfloat16)
    for isa in ("scalar", "avx2", "avx512"):
        if cpu_gemv.ISA_CHOICES.index(isa) > cpu_gemv.ISA_CHOICES.index(cpu_gemv.supported_isa()):
            continue
        cpu_gemv.set_isa(isa)
        if isa != "avx512":
            assert not cpu_gemv_blocks.gemm_runs(layout)
        if cpu_gemv_blocks.gemm_runs(layout):
            assert cpu_gemv_blocks.gemm(layout, x).shape == (3, layout.n)
        else:
            with pytest.raises(UsageError, match="does not run here"):
                cpu_gemv_blocks.gemm(layout, x)


@GEMM
def test_refusals_are_typed() -> None:
    layout = cpu_gemv_blocks.block_layout_of(weight_of("gguf/Q8_0"))
    x = torch.randn(2, layout.k).to(torch.bfloat16)
    with pytest.raises(UsageError, match="bfloat16 x of shape"):
        cpu_gemv_blocks.gemm(layout, x.float())
    with pytest.raises(UsageError, match="bfloat16 x of shape"):
        cpu_gemv_blocks.gemm(layout, x[:, :32])
    with pytest.raises(UsageError, match=r"rows \[0, 38\) are not within N=37"):
        cpu_gemv_blocks.gemm(layout, x, None, 0, 38)
    with pytest.raises(UsageError, match="out must be bfloat16"):
        cpu_gemv_blocks.gemm(layout, x, out=torch.empty(2, 36, dtype=torch.bfloat16))
    with pytest.raises(UsageError, match="bias has shape"):
        cpu_gemv_blocks.gemm(layout, x, torch.zeros(5))


@GEMM
def test_the_op_has_a_fake_implementation() -> None:
    layout = cpu_gemv_blocks.block_layout_of(weight_of("gguf/IQ4_XS"))
    c = layout.compiled
    x = torch.randn(2, layout.k).to(torch.bfloat16)
    torch.library.opcheck(
        torch.ops.qscheme.cpu_gemm_blocks.default,
        (x, layout.codes, c.program, c.values, c.byte_tables, torch.randn(layout.n), list(layout.meta), 3, 30, 1),
        test_utils=("test_schema", "test_faketensor"),
    )

    def both(v: torch.Tensor) -> torch.Tensor:
        y = torch.zeros(v.shape[0], layout.n, dtype=torch.bfloat16)
        cpu_gemv_blocks.gemm(layout, v, None, 4, layout.n, out=y[:, 4:])
        return y

    compiled = torch.compile(both, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), both(x))
    assert bool((both(x)[:, 4:] != 0).any())


@pytest.mark.parametrize("name", ["gguf/Q4_0", "gguf/Q6_K", "gguf/Q8_0"])
def test_the_plan_takes_it_from_m_5_where_it_runs(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 inputs: the blocks' GEMV below M = 5 and cpu_gemm_blocks from 5 where it runs (from 4
    for blocks of 8 bits a weight and more: Q8_0, and for every type where it multiplies on the AMX
    tiles), at every larger M; else rejected with its reason (the GEMVs up to 15, dequant_gemm from
    16). float32 inputs never take it."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    weight = weight_of(name, 72)
    with isolated_plugins():
        resolution = registry.resolve_layer(weight.scheme, problem_for(weight, "bfloat16"), "cpu")
        candidate = resolution.candidate("cpu_gemm_blocks")
        plan = resolution.plan  # type: ignore[attr-defined]
        if cpu_gemv_blocks.gemm_available():
            assert candidate.accepted
            first = 4 if name == "gguf/Q8_0" or cpu_gemv_blocks.gemm_loops() == "amx" else 5
            assert [plan.kernel_for(m).name for m in (first, 8, 16, 47, 48, 256)] == ["cpu_gemm_blocks"] * 6
            assert plan.kernel_for(first - 1).name != "cpu_gemm_blocks"
        else:
            assert not candidate.accepted and "fused GEMM" in str(candidate.reasons)
            assert plan.kernel_for(16).name == "dequant_gemm"
        floats = registry.resolve_layer(weight.scheme, problem_for(weight, "float32"), "cpu")
        assert not floats.candidate("cpu_gemm_blocks").accepted
        assert floats.plan.kernel_for(16).name == "dequant_gemm"  # type: ignore[attr-defined]


@GEMM
@pytest.mark.parametrize("name", ["gguf/Q4_K", "gguf/Q6_K"])
def test_a_layer_runs_it_and_holds_the_blocks_alone(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A QuantLinear forward at M = 1, 8 and 18 (3-D, bias): the GEMV, then the GEMM, equal to
    ``gemm`` itself; the layer holds its canonical blocks and the small program only."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    weight = weight_of(name, 72)
    generator = torch.Generator().manual_seed(8)
    bias = torch.randn(weight.n, generator=generator).to(torch.bfloat16)
    layout = cpu_gemv_blocks.block_layout_of(weight)
    with isolated_plugins():
        layer = QuantLinear(weight, bias=bias)
        ran = []
        with torch.inference_mode():
            for shape in ((1,), (2, 4), (3, 6)):
                m = int(torch.Size(shape).numel())
                ran.append(layer.kernel_for_batch(m).name)
                x = torch.randn(*shape, weight.k, generator=generator).to(torch.bfloat16)
                y = layer(x)
                assert y.shape == (*shape, weight.n) and y.dtype == torch.bfloat16
                if ran[-1] == "cpu_gemm_blocks":
                    assert torch.equal(y.reshape(m, -1), cpu_gemv_blocks.gemm(layout, x.reshape(m, -1), bias))
        assert ran == ["cpu_gemv_blocks_bf16", "cpu_gemm_blocks", "cpu_gemm_blocks"]
        canonical = kernel_table.canonical_bytes(layer)
        small = sum(t.numel() * t.element_size() for t in (*layout.tensors().values(), bias)) - layout.codes.numel()
        assert canonical <= sum(kernel_table.resident_bytes(layer).values()) <= canonical + small


@GEMM
def test_the_kernel_refuses_what_it_does_not_take() -> None:
    weight = weight_of("gguf/Q4_0", 40)
    kernel = CpuGemmBlocksKernel()
    state = kernel.prepare(weight, torch.device("cpu"))
    with pytest.raises(UsageError, match="takes bfloat16 inputs"):
        kernel.apply(state, torch.randn(9, weight.k), None)
    with pytest.raises(UsageError, match=f"K={weight.k}"):
        kernel.apply(state, torch.randn(9, 64).to(torch.bfloat16), None)
    before = cpu_gemv.isa()
    cpu_gemv.set_isa("avx2")
    try:
        with pytest.raises(UsageError, match="cpu_gemm_blocks does not run scheme gguf/Q4_0 here"):
            kernel.prepare(weight, torch.device("cpu"))
    finally:
        cpu_gemv.set_isa(before)


@pytest.mark.parametrize(
    ("loops", "name", "expected"),
    [
        ("amx", "gguf/Q4_K", (4, None)),
        ("amx", "gguf/Q8_0", (4, None)),
        ("avx512", "gguf/Q4_K", (5, None)),
        ("avx512", "gguf/Q8_0", (4, None)),
    ],
)
def test_on_the_amx_tiles_it_takes_every_m_from_4(
    loops: str, name: str, expected: tuple[int, int | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The declared ranges under each multiply, whatever this CPU runs: on the AMX tiles the fused GEMM
    takes every type from M = 4, with VDPBF16PS from 5 (4 for blocks of 8 bits a weight); no end."""
    monkeypatch.setattr(cpu_gemv_blocks, "gemm_loops", lambda: loops)
    weight = weight_of(name, 72)
    blocks = weight.scheme.weight.blocks
    assert blocks is not None
    problem = replace(problem_for(weight, "bfloat16"), weight_bits=blocks.bits_per_weight)
    assert CPU_GEMM_BLOCKS.batch_range("cpu", problem) == expected
    source = CPU_GEMM_BLOCKS.batch_ranges[0].source
    assert "AMX" in source and "M = 4" in source
