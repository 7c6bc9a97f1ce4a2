"""The ``dequant_gemm`` kernel's tile decoder and fused tile GEMM (``qscheme.tile_gemm``), and
the kernel on every scheme family it claims, against the reference dequantization and kernel.

- The decoder, on every ISA this CPU runs (the portable loop always): bit for bit
  ``dequantize(weight).to(bfloat16)``, for every code and scale format, ragged K, row ranges.
- The fused GEMM (on AMX tiles and on AVX-512 BF16, each where this CPU runs it): the bfloat16
  weight times the bfloat16 input summed in float32 and rounded once (a float32 sum in another
  order), on every blocking of M (one accumulator set, accumulators saved across K chunks),
  ragged N and K, M = 0 and 1, bias, output column ranges.
- The kernel (``DequantGemmKernel``, whichever path runs here, and the torch path): within its
  declared bound of the reference kernel, for weight-only and quantized-activation schemes (FP8,
  FP8_DYNAMIC, NVFP4 W4A4), fused partitions with their own global and input scales, 3-D inputs.
- Plans on a CPU: int4 runs cpu_gemv up to M = 15 and dequant_gemm from M = 16, also under
  the Triton interpreter (the interpreted Triton kernel never takes a batch size from it).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kernel_fakes import isolated_plugins
from qscheme_plugins.dequant_gemm_kernel import DequantGemmKernel
from qscheme_plugins.reference_kernel import ReferenceKernel
from triton_samples import uint8_group_scheme

from qscheme import cpu_gemv, emulation_native, tile_gemm
from qscheme.canonical import CanonicalWeight, canonicalize, dequantize
from qscheme.catalog import load_scheme
from qscheme.kernels import registry
from qscheme.kernels.resolver import resolve
from qscheme.modules import QuantLinear, problem_for
from qscheme.quantize import quantize_weight
from qscheme.triton.samples import model_scale_dtype, random_weight

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
kernel_table = importlib.import_module("kernel_table")

needs_extension = pytest.mark.skipif(not tile_gemm.available(), reason="qscheme._tile_gemm is not built here")
needs_fused = pytest.mark.skipif(
    not tile_gemm.available() or tile_gemm.native().supported_isa() not in tile_gemm.FUSED_ISAS,
    reason="this CPU (or its kernel) runs neither AMX tiles nor AVX-512 BF16",
)

WEIGHT_ONLY = (
    "compressed-tensors/NVFP4A16",  # e2m1, e4m3 group-16 scales, a global scale
    "compressed-tensors/MXFP4A16",  # e2m1, e8m0 group-32 scales
    "compressed-tensors/W4A16",  # int4, group 128
    "compressed-tensors/W4A16_ASYM",  # uint4 with zero points
    "modelopt/W4A16_AWQ",  # an input pre-scale
    "compressed-tensors/W8A16_G32",  # int8, group 32
    "gptq/W8A16_ASYM",  # int8 with zero points, group 128
    "modelopt/fp8_pb_wo",  # e4m3 with 128x128 block scales
    "bitsandbytes/NF4_DQ",  # a 16-value codebook, quantized scales
)
ACTIVATIONS = ("compressed-tensors/FP8_DYNAMIC", "compressed-tensors/FP8", "compressed-tensors/NVFP4")
SHAPES = ((96, 128), (100, 200), (72, 600))  # ragged N against the 32-row panels, ragged K (K % 32)


@pytest.fixture(autouse=True)
def isa_restored() -> Iterator[None]:
    before = tile_gemm.isa() if tile_gemm.available() else None
    yield
    if before is not None:
        tile_gemm.set_isa(before)


def weight_of(name: str, n: int, k: int, partitions: tuple[int, ...] | None = None, seed: int = 1) -> CanonicalWeight:
    scheme = load_scheme(name)
    return random_weight(scheme, n, k, partitions, seed=seed, scale_dtype=model_scale_dtype(scheme, torch.bfloat16))


def isas(choices: tuple[str, ...] = ("scalar", "avx512")) -> list[str]:
    supported = tile_gemm.native().supported_isa()
    return [isa for isa in choices if tile_gemm.ISA_CHOICES.index(isa) <= tile_gemm.ISA_CHOICES.index(supported)]


@needs_extension
@pytest.mark.parametrize("name", (*WEIGHT_ONLY, "compressed-tensors/FP8"))
def test_the_decoder_is_the_reference_dequantization_rounded_once(name: str) -> None:
    for n, k in SHAPES:
        weight = weight_of(name, n, k)
        layout = cpu_gemv.layout_of(weight)
        exact = dequantize(weight).to(torch.bfloat16)
        for isa in isas():
            tile_gemm.set_isa(isa)
            decoded = tile_gemm.dequantize_rows(layout, 0, n, threads=2)
            assert torch.equal(decoded.view(torch.int16), exact.view(torch.int16)), (name, n, k, isa)
            middle = tile_gemm.dequantize_rows(layout, 33, 70, threads=1)
            assert torch.equal(middle.view(torch.int16), exact[33:70].view(torch.int16)), (name, n, k, isa)


@needs_extension
@pytest.mark.parametrize(
    ("name", "edge"),
    [
        ("compressed-tensors/MXFP4A16", [0, 1, 127, 254, 255]),  # e8m0: 2**-127 (subnormal), NaN
        ("compressed-tensors/NVFP4A16", [0x00, 0x01, 0x07, 0x08, 0x7E, 0x7F, 0x80, 0xFF]),  # e4m3: subnormal, NaN
    ],
)
def test_edge_scale_bytes_decode_as_the_reference_does(name: str, edge: list[int]) -> None:
    """Byte scales are decoded by arithmetic in the vector loops: the subnormal and NaN codes too.
    The AVX-512 loops round with VCVTNE2PS2BF16, which reads a float32 subnormal weight as zero
    (declared: AMX reads bfloat16 subnormals as zero anyway); the portable loop keeps it."""
    weight = weight_of(name, 32, 256)
    assert weight.scale is not None
    raw = weight.scale.view(torch.uint8).clone()
    raw[0, : len(edge)] = torch.tensor(edge, dtype=torch.uint8)
    weight = dataclasses.replace(weight, scale=raw.view(weight.scale.dtype))
    reference = dequantize(weight).to(torch.bfloat16)
    flushed = torch.where(reference.float().abs() < 2.0**-126, reference * 0, reference)  # signed zeros
    subnormal = (reference.float().abs() < 2.0**-126) & (reference != 0)
    assert subnormal.any() == (name == "compressed-tensors/MXFP4A16")  # e8m0's 0 byte makes subnormal weights
    assert reference.isnan().any()  # and the NaN bytes NaN weights
    for isa in isas():
        tile_gemm.set_isa(isa)
        exact = reference if isa == "scalar" else flushed
        decoded = tile_gemm.dequantize_rows(cpu_gemv.layout_of(weight), 0, 32)
        assert torch.equal(decoded.isnan(), exact.isnan()), isa
        finite = ~exact.isnan()
        assert torch.equal(decoded[finite].view(torch.int16), exact[finite].view(torch.int16)), isa


@needs_extension
def test_unsigned_byte_codes_with_zero_points_decode_as_the_reference() -> None:
    """No shipped scheme stores uint8 weights: the tests' own declaration."""
    scheme = uint8_group_scheme()
    values = torch.randn(40, 200, generator=torch.Generator().manual_seed(6)) * 0.05 + 0.02
    weight = canonicalize(scheme, quantize_weight(values, scheme))
    assert weight.zero_point is not None and cpu_gemv.layout_of(weight).meta[0] == cpu_gemv.CODE_UINT8
    exact = dequantize(weight).to(torch.bfloat16)
    for isa in isas():
        tile_gemm.set_isa(isa)
        decoded = tile_gemm.dequantize_rows(cpu_gemv.layout_of(weight), 0, weight.n, threads=2)
        assert torch.equal(decoded.view(torch.int16), exact.view(torch.int16)), isa


E4M3_SCALES = (1.5, -0.75, 2.0**-120, 2.0**-130, 3.0e38, 448.0, float("inf"), float("nan"), -float("inf"), 1.0)


@needs_extension
@pytest.mark.parametrize("name", ("compressed-tensors/FP8_DYNAMIC", "modelopt/fp8_pb_wo"))
def test_every_e4m3_code_under_every_kind_of_scale_decodes_as_the_reference(name: str) -> None:
    """The AVX-512 decoder looks e4m3 codes up in a table of each group's 128 magnitudes times its
    scale and flips the sign for codes 0x80-0xFF. Every byte (both zeros, subnormals, NaN) under
    scales that are negative, tiny (products that are float32 subnormals: flushed, signed zeros),
    huge (products that overflow) and not finite (their groups take the arithmetic loop) gives the
    reference's bits."""
    n, k = 10, 1280  # per channel: a scale per row; blocks of 128 x 128: a scale per 128 columns
    weight = weight_of(name, n, k)
    codes = ((torch.arange(k) * 7)[None, :] + torch.arange(n)[:, None] * 13) % 256
    scale = torch.tensor(E4M3_SCALES, dtype=torch.float32)
    scale = scale[: weight.scale.numel()] if weight.scale.numel() <= scale.numel() else scale.repeat(2)
    assert weight.scale.numel() == scale.numel() == len(E4M3_SCALES), weight.scale.shape
    weight = dataclasses.replace(
        weight,
        codes=codes.to(torch.uint8).view(weight.codes.dtype),
        scale=scale.reshape(weight.scale.shape).to(weight.scale.dtype),
    )
    reference = dequantize(weight).to(torch.bfloat16)
    flushed = torch.where(reference.float().abs() < 2.0**-126, reference * 0, reference)  # signed zeros
    assert reference.isnan().any() and reference.isinf().any() and (flushed != reference).any()
    for isa in isas():
        tile_gemm.set_isa(isa)
        exact = reference if isa == "scalar" else flushed
        decoded = tile_gemm.dequantize_rows(cpu_gemv.layout_of(weight), 0, n)
        assert torch.equal(decoded.isnan(), exact.isnan()), isa
        finite = ~exact.isnan()
        assert torch.equal(decoded[finite].view(torch.int16), exact[finite].view(torch.int16)), isa


def exact_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The bfloat16 products summed in float32 (float64 here: the float32 sum differs by its order)."""
    y = x.double() @ weight.double().T
    return y if bias is None else y + bias.double()


def assert_gemm_close(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """y is the float32 sum of bf16(x) * bf16(w) (+ bias) rounded once to bfloat16: within half a
    bfloat16 ulp of the exact sum, plus K float32 roundings of the magnitude."""
    exact = exact_gemm(x, weight, bias)
    magnitude = x.double().abs() @ weight.double().abs().T + (0 if bias is None else bias.double().abs())
    bound = 2.0**-8 * exact.abs() + (x.shape[-1] + 2) * 2.0**-24 * magnitude + 1e-30
    assert ((y.double() - exact).abs() <= bound).all()


@needs_fused
@pytest.mark.parametrize("name", WEIGHT_ONLY)
def test_the_fused_gemm_multiplies_the_rounded_weight(name: str) -> None:
    """On each fused loop this CPU runs (AMX tiles, VDPBF16PS dot products)."""
    generator = torch.Generator().manual_seed(5)
    for n, k in SHAPES:
        weight = weight_of(name, n, k)
        layout = cpu_gemv.layout_of(weight)
        rounded = dequantize(weight).to(torch.bfloat16)
        bias = torch.randn(n, generator=generator)
        for m in (1, 16, 32, 37) if k < 512 else (1, 37, 150):
            x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
            # whatever blocking ``blocking`` picks, and each one it may pick: whole rows of 32 (one
            # accumulator set up to M = 32), K in chunks (accumulators kept in the tiles or saved
            # across K), 64- and 256-row tasks
            for isa in isas(tile_gemm.FUSED_ISAS):
                tile_gemm.set_isa(isa)
                for chosen in (None, (32, 4096), (32, 64), (64, 512), (256, 256)):
                    with pytest.MonkeyPatch.context() as patch:
                        if chosen is not None:
                            patch.setattr(tile_gemm, "blocking", lambda rows, loops, chosen=chosen: chosen)
                        y = tile_gemm.gemm(layout, x, bias)
                        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
                        assert_gemm_close(y, x, rounded, bias)
                        part = tile_gemm.gemm(layout, x, None, 40, n, threads=1)  # output columns [40, N), no bias
                        assert_gemm_close(part, x, rounded[40:], None)
                empty = tile_gemm.gemm(layout, x[:0])
                assert empty.shape == (0, n)


@needs_fused
def test_the_fused_gemm_refuses_what_it_does_not_take() -> None:
    layout = cpu_gemv.layout_of(weight_of("compressed-tensors/NVFP4A16", 96, 128))
    with pytest.raises(Exception, match="bfloat16 x of shape"):
        tile_gemm.gemm(layout, torch.randn(4, 128))
    with pytest.raises(Exception, match=r"rows \[0, 97\) are not within N=96"):
        tile_gemm.gemm(layout, torch.randn(4, 128).to(torch.bfloat16), None, 0, 97)
    tile_gemm.set_isa("scalar")
    with pytest.raises(Exception, match="runs on AMX or AVX-512 BF16"):
        tile_gemm.gemm(layout, torch.randn(4, 128).to(torch.bfloat16))


def declared_bound(x: torch.Tensor, effective: torch.Tensor, bias: torch.Tensor | None, y16: torch.Tensor) -> None:
    """dequant_gemm's bfloat16 bound: weight and (pre-scaled or emulated) input each rounded once
    to bfloat16, products summed in float32, the output rounded once."""
    reference = x.double() @ effective.double().T + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ effective.double().abs().T + (0 if bias is None else bias.double().abs())
    assert ((y16.double() - reference).abs() <= 2.0**-7 * magnitude + 2.0**-8 * reference.abs() + 1e-6).all()


@pytest.mark.parametrize("name", (*ACTIVATIONS, "modelopt/W4A16_AWQ", "compressed-tensors/NVFP4A16"))
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_the_kernel_is_within_its_bound_of_the_reference_kernel(name: str, native: bool) -> None:
    """Fused partitions (their own global and input scales), a 3-D input, bias: the reference
    kernel's emulated float32 input and output, against dequant_gemm with bfloat16 inputs (whichever
    path runs: AMX tiles, decoded tiles and torch's GEMM) and float32 inputs."""
    n, k = 160, 256
    weight = weight_of(name, n, k, partitions=(64, 32, 64), seed=3)
    kernel, reference = DequantGemmKernel(native=native), ReferenceKernel()
    state, reference_state = kernel.prepare(weight, torch.device("cpu")), reference.prepare(weight, torch.device("cpu"))
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(2, 20, k, generator=generator)
    bias = torch.randn(n, generator=generator)
    effective = dequantize(weight)
    xb, bb = x.to(torch.bfloat16), bias.to(torch.bfloat16)
    y16 = kernel.apply(state, xb, bb)
    assert y16.dtype == torch.bfloat16 and y16.shape == (2, 20, n)
    # the reference kernel's own float32 input per partition run (pre-scaled, quantized, dequantized)
    expected = reference.apply(reference_state, xb.float(), bb.float())
    pieces = reference.quantize_input(reference_state, xb.reshape(-1, k))
    for scaling, values in pieces:
        start, stop = (0, n) if scaling is None else (scaling.start, scaling.stop)
        declared_bound(values, effective[start:stop], bb.float()[start:stop], y16.reshape(-1, n)[:, start:stop])
    y32 = kernel.apply(state, x, bias)
    torch.testing.assert_close(y32, reference.apply(reference_state, x, bias), rtol=1e-5, atol=1e-5)
    assert ((y16.float() - expected).abs() <= 2.0**-5 * expected.abs().max() + 1e-3).all()
    empty = kernel.apply(state, xb[:, :0], None)
    assert empty.shape == (2, 0, n)


@pytest.mark.parametrize(("loops", "first"), [("avx512", 5), ("amx", 16), ("scalar", 16)])
def test_int4_runs_the_gemv_then_the_tiles_even_under_the_triton_interpreter(
    loops: str, first: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bfloat16 inputs: the tiles from M = 5 where they run VDPBF16PS dot products (AVX512-BF16, no
    AMX: measured there), from M = 16 elsewhere; float32 inputs from 48 where cpu_gemv runs its AVX-512
    loops (measured there), from 16 elsewhere."""
    weight = weight_of("compressed-tensors/W4A16", 256, 512)
    # cpu_gemv's int4 entry ranks above tinygemm_cpu; without its loops (no extension, no AVX2) tinygemm_cpu
    gemv = "cpu_gemv" if cpu_gemv.available() and cpu_gemv.supported_isa() != "scalar" else "tinygemm_cpu"
    monkeypatch.setattr(tile_gemm, "isa", lambda: loops)
    for interpreted in (False, True):
        if interpreted:
            monkeypatch.setenv("TRITON_INTERPRET", "1")
        else:
            monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with isolated_plugins():
            resolution = registry.resolve_layer(weight.scheme, problem_for(weight, "bfloat16"), "cpu")
            plan = resolution.plan  # type: ignore[attr-defined]
            assert interpreted == resolution.candidate("triton").accepted
            sizes = (1, first - 1, first, 256)
            assert [plan.kernel_for(m).name for m in sizes] == [gemv, gemv, "dequant_gemm", "dequant_gemm"]
            if gemv == "cpu_gemv":  # float32 inputs (tinygemm_cpu takes none): 48 on cpu_gemv's AVX-512 loops
                for gemv_loops, start in (("avx512", 48), ("avx2", 16)):
                    monkeypatch.setattr(cpu_gemv, "isa", lambda loops=gemv_loops: loops)
                    # the resolver itself: registry.resolve_layer memoises per layer, and only the loops change here
                    problem = problem_for(weight, "float32")
                    float32 = resolve(weight.scheme, problem, registry.device_for("cpu"), registry.declarations()).plan
                    sizes = (1, start - 1, start)
                    assert [float32.kernel_for(m).name for m in sizes] == [gemv, gemv, "dequant_gemm"], (
                        gemv_loops,
                        float32.describe(),
                    )


@pytest.mark.parametrize("name", ["compressed-tensors/FP8_DYNAMIC", "compressed-tensors/NVFP4A16"])
def test_a_layer_runs_the_tiles_from_16_and_holds_no_copy(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """After forwards at M = 1, 16 and 64 the layer holds its canonical tensors and small tables:
    the tiles (and the extension's buffers) are transient."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with isolated_plugins():
        layer = QuantLinear(weight_of(name, 128, 1024))
        assert layer.kernel_for_batch(16).name == "dequant_gemm"
        ran = []
        with torch.inference_mode():
            for m in (1, 16, 64):
                ran.append(layer.kernel_for_batch(m).name)
                layer(torch.randn(m, 1024).to(torch.bfloat16))
        assert ran[1:] == ["dequant_gemm", "dequant_gemm"]
        canonical = kernel_table.canonical_bytes(layer)
        assert canonical <= sum(kernel_table.resident_bytes(layer).values()) <= 1.05 * canonical


@pytest.mark.parametrize("name", ["gguf/Q4_K", "gguf/Q6_K", "gguf/Q8_0", "gguf/IQ4_XS"])
def test_packed_blocks_decode_their_tiles_with_the_block_decoder(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """GGUF blocks: where cpu_gemv_blocks' AVX-512 decoder runs, the tiles come from it (the torch
    decoder is never called), bit for bit the reference's weights rounded once to bfloat16 (float32
    as they are); the output is the bfloat16 (float32) product over them, a 3-D input with bias."""
    from qscheme_plugins import dequant_gemm_kernel

    from qscheme import cpu_gemv_blocks
    from qscheme.canonical_blocks import canonical_blocks
    from qscheme.producers.gguf.quants.api import quantize_blocks

    n, k = 72, 512
    scheme = load_scheme(name)
    dense = torch.randn(n, k, generator=torch.Generator().manual_seed(5))
    weight = canonical_blocks(scheme, quantize_blocks(dense, name.removeprefix("gguf/")), n, k)
    state = DequantGemmKernel().prepare(weight, torch.device("cpu"))
    decoder_runs = cpu_gemv.available() and cpu_gemv.isa() == "avx512"
    assert (state.blocks is not None) == cpu_gemv.available()
    if decoder_runs:

        def refused(*args: object, **kwargs: object) -> None:
            raise AssertionError("the torch decoder ran")

        monkeypatch.setattr(dequant_gemm_kernel, "dequantize_rows", refused)
        assert cpu_gemv_blocks.dequantize_rows(state.blocks, 0, 1) is not None
    reference = dequantize(weight)
    for dtype in (torch.bfloat16, torch.float32):
        tiles = torch.cat([rows for _, _, rows in dequant_gemm_kernel.dequantized_tiles(state, dtype)])
        assert tiles.dtype == dtype
        assert torch.equal(tiles.float(), reference.to(dtype).float())
        generator = torch.Generator().manual_seed(6)
        x = torch.randn(2, 9, k, generator=generator).to(dtype)
        bias = torch.randn(n, generator=generator).to(dtype)
        y = DequantGemmKernel().apply(state, x, bias)
        expected = torch.nn.functional.linear(x.float(), tiles.float(), bias.float())
        assert y.dtype == dtype and y.shape == (2, 9, n)
        tolerance = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-18
        scale = expected.abs() + x.float().abs().sum(-1, keepdim=True)
        assert ((y.float() - expected).abs() <= tolerance * scale).all()


FUSED_PASSES = (
    "compressed-tensors/FP8",  # FP8 per tensor (static)
    "compressed-tensors/FP8_DYNAMIC",  # FP8 per token
    "compressed-tensors/FP8_BLOCK",  # FP8 per group of 128
    "compressed-tensors/W8A8",  # int8 per token
    "modelopt/W4A16_AWQ",  # the pre-scale alone
)


@needs_fused
@pytest.mark.parametrize("name", FUSED_PASSES)
@pytest.mark.parametrize("m", [5, 37, 70])  # rows past the pairs' blocks of 16; a ragged K below
def test_the_fused_gemm_applies_the_input_pass_as_the_reference_does(
    name: str, m: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the input pass in the GEMM (each row quantized as it is padded) the output is bit for bit
    the GEMM of the reference kernel's input rounded to bfloat16 (QSCHEME_NATIVE_EMULATION=0: the
    torch path prepares it first), fused partitions with their own static scales included; and the
    fused path does not prepare the input apart."""
    n, k = 160, 200
    weight = weight_of(name, n, k, partitions=(64, 32, 64), seed=5)
    kernel = DequantGemmKernel(native=True)
    state = kernel.prepare(weight, torch.device("cpu"))
    generator = torch.Generator().manual_seed(m)
    x = (torch.randn(m, k, generator=generator) * torch.logspace(-3, 3, m).reshape(m, 1)).to(torch.bfloat16)
    bias = torch.randn(n, generator=generator).to(torch.bfloat16)
    with monkeypatch.context() as patch:
        patch.setenv(emulation_native.VARIABLE, "0")
        expected = kernel.apply(state, x, bias)
    reference = ReferenceKernel()
    given = reference.quantize_input(reference.prepare(weight, torch.device("cpu")), x, torch.bfloat16)
    assert len(given) == (3 if name == "compressed-tensors/FP8" else 1)  # per tensor: each partition its scale
    prepared: list[torch.Tensor] = []
    original = emulation_native.apply_pass

    def recording(*args: object, **kwargs: object) -> torch.Tensor | None:
        found = original(*args, **kwargs)  # type: ignore[arg-type]
        if found is not None:
            prepared.append(found)
        return found

    monkeypatch.setattr(emulation_native, "apply_pass", recording)
    fused = kernel.apply(state, x, bias)
    assert not prepared  # the GEMM quantized the rows itself
    assert torch.equal(fused.view(torch.int16), expected.view(torch.int16))
    for scaling, values in given:  # and the unfused path multiplies the reference's rows
        start, stop = (0, n) if scaling is None else (scaling.start, scaling.stop)
        alone = tile_gemm.gemm(state.native, values, bias.float(), start, stop)
        assert torch.equal(alone.view(torch.int16), expected[:, start:stop].view(torch.int16))


@needs_fused
def test_the_fused_gemm_writes_its_output_view_under_torch_compile() -> None:
    """``out`` (a view of a wider output, as dequant_gemm passes it) is written when compiled too."""
    weight = weight_of("compressed-tensors/NVFP4A16", 96, 128)
    layout = cpu_gemv.layout_of(weight)
    x = torch.randn(3, 128).to(torch.bfloat16)

    def into_view(v: torch.Tensor) -> torch.Tensor:
        y = torch.zeros(v.shape[0], 96, dtype=torch.bfloat16)
        tile_gemm.gemm(layout, v, None, 40, 96, out=y[:, 40:])
        return y

    eager = into_view(x)
    assert bool((eager[:, 40:] != 0).any()) and bool((eager[:, :40] == 0).all())
    assert torch.equal(torch.compile(into_view, fullgraph=True, backend="eager")(x), eager)
