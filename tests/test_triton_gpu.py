"""The Triton kernel compiled for and run on a real CUDA GPU (skipped without one), against the
reference kernel on the same device, for every built-in scheme. The interpreter tests cover
exactness on CPU; this catches what only real hardware shows (layouts, masks, PTX paths)."""

from __future__ import annotations

import pytest
import torch
from qscheme_plugins.reference_kernel import ReferenceKernel
from qscheme_plugins.triton_kernel import TritonKernel

from qscheme.canonical import canonicalize
from qscheme.catalog import load_catalog
from qscheme.descriptor import Scheme
from qscheme.kernels.problem import Problem
from qscheme.kernels.resolver import check_layout
from qscheme.quantize import quantize_weight

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
BUILTIN = [s for s in load_catalog(include_plugins=False) if s.weight.blocks is None]  # blocks: not Triton's
SHAPES = [(1, 160, 256), (16, 512, 1024), (37, 4096, 4096)]


def static_inputs(scheme: Scheme, k: int, amax: float = 4.0) -> dict[str, torch.Tensor]:
    activation, given = scheme.activation, {}
    if activation is not None and activation.scale is not None:
        multiplier = amax / 448.0
        given[activation.scale.tensor.name] = torch.tensor(
            [multiplier if activation.scale.stored == "multiplier" else 1 / multiplier]
        )
    if activation is not None and activation.global_scale is not None:
        multiplier = amax / 2688.0
        stored = activation.global_scale.stored
        given[activation.global_scale.tensor.name] = torch.tensor(
            [multiplier if stored == "multiplier" else 1 / multiplier]
        )
    if scheme.input_pre_scale is not None:
        given[scheme.input_pre_scale.name] = torch.rand(k, generator=torch.Generator().manual_seed(2)) + 0.5
    return given


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
@pytest.mark.parametrize("scheme", BUILTIN, ids=[s.name for s in BUILTIN])
def test_triton_on_gpu_matches_the_reference(scheme: Scheme, m: int, n: int, k: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(m + n + k)
    weight = torch.randn(n, k, generator=generator) * 0.05
    canonical = canonicalize(scheme, quantize_weight(weight, scheme, **static_inputs(scheme, k)))
    device = torch.device("cuda")
    x = (torch.randn(m, k, generator=generator) * 2).to(dtype).to(device)
    bias = torch.randn(n, generator=generator).to(device)
    triton_kernel, reference = TritonKernel(), ReferenceKernel()
    actual = triton_kernel.apply(triton_kernel.prepare(canonical, device), x, bias)
    expected = reference.apply(reference.prepare(canonical, device), x.float(), bias).double()
    assert actual.dtype == dtype and actual.shape == (m, n)
    error = float((actual.double() - expected).abs().max())
    scale = float(expected.abs().max())
    assert error <= 1e-2 * scale, f"{scheme.name} {m}x{n}x{k} {dtype}: max error {error:.3e}, output scale {scale:.3e}"


# int4 / uint4 weight-only schemes whose quantizer keeps scales in the weight's dtype
# (ModelOpt's W4A16_AWQ keeps float32 scales: the float32 decode of the test above).
INT4_WEIGHT_ONLY = [s for s in BUILTIN if s.name in ("compressed-tensors/W4A16", "compressed-tensors/W4A16_ASYM")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
@pytest.mark.parametrize("scheme", INT4_WEIGHT_ONLY, ids=[s.name for s in INT4_WEIGHT_ONLY])
def test_int4_with_scales_in_the_model_dtype_decodes_in_16_bit(
    scheme: Scheme, m: int, n: int, k: int, dtype: torch.dtype
) -> None:
    """Checkpoints keep int4 group scales in the model's dtype; with inputs in that dtype the
    kernel decodes, subtracts zero points and scales in 16-bit registers (the PTX paths)."""
    from qscheme.triton.linear import decode_dtype, prepare_weight
    from qscheme.triton.spec import DECODE_FP32

    generator = torch.Generator().manual_seed(m + n + k)
    weight = (torch.randn(n, k, generator=generator) * 0.05).to(dtype)
    canonical = canonicalize(scheme, quantize_weight(weight, scheme, **static_inputs(scheme, k)))
    assert canonical.scale.dtype == dtype
    device = torch.device("cuda")
    assert decode_dtype(prepare_weight(canonical, device).spec, dtype, dtype, True) != DECODE_FP32
    x = (torch.randn(m, k, generator=generator) * 2).to(dtype).to(device)
    triton_kernel, reference = TritonKernel(), ReferenceKernel()
    actual = triton_kernel.apply(triton_kernel.prepare(canonical, device), x, None)
    expected = reference.apply(reference.prepare(canonical, device), x.float(), None).double()
    error = float((actual.double() - expected).abs().max())
    scale = float(expected.abs().max())
    assert error <= 1e-2 * scale, f"{scheme.name} {m}x{n}x{k} {dtype}: max error {error:.3e}, output scale {scale:.3e}"


FUSED_SPLIT_K = [
    s
    for s in BUILTIN
    if s.name in ("compressed-tensors/NVFP4A16", "compressed-tensors/W4A16", "compressed-tensors/NVFP4")
]


@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("scheme", FUSED_SPLIT_K, ids=[s.name for s in FUSED_SPLIT_K])
def test_fused_split_k_gives_the_two_pass_bits_on_gpu(scheme: Scheme, m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """QSCHEME_TRITON_SPLIT_K=fused (the last program of each tile reduces, behind an arrival
    counter): bit for bit the two-pass result, over repeated calls (the counters reset)."""
    from qscheme.triton import linear as lin
    from qscheme.triton.configs import TileConfig

    generator = torch.Generator().manual_seed(m)
    n = k = 4096
    weight = (torch.randn(n, k, generator=generator) * 0.05).to(torch.bfloat16)
    canonical = canonicalize(scheme, quantize_weight(weight, scheme, **static_inputs(scheme, k)))
    device = torch.device("cuda")
    prepared = lin.prepare_weight(canonical, device)
    x = (torch.randn(m, k, generator=generator) * 2).to(torch.bfloat16).to(device)
    bias = torch.randn(n, generator=generator).to(torch.bfloat16).to(device)
    tile = TileConfig(16, 64, 128, split_k=4, num_warps=4, num_stages=4)
    monkeypatch.setenv(lin.SPLIT_K_VARIABLE, "two-pass")
    expected = lin.linear(prepared, x, bias, tile)
    monkeypatch.setenv(lin.SPLIT_K_VARIABLE, "fused")
    for _ in range(3):
        assert torch.equal(lin.linear(prepared, x, bias, tile), expected)
    torch.cuda.synchronize()
    assert all(int(c.abs().max()) == 0 for c in lin._COUNTERS.values())


WEIGHTS_FIRST = [
    (scheme, dtype)
    for scheme in BUILTIN
    for dtype in (torch.bfloat16, torch.float16)
    if scheme.name in ("compressed-tensors/NVFP4A16", "compressed-tensors/W4A16")
    or (
        dtype == torch.bfloat16
        and scheme.name in ("compressed-tensors/NVFP4", "compressed-tensors/MXFP4A16", "modelopt/W4A16_AWQ")
    )
]


@pytest.mark.parametrize(("m", "n", "k"), [(1, 4096, 4096), (16, 1000, 2304)], ids=["1x4096x4096", "16x1000x2304"])
@pytest.mark.parametrize(
    ("scheme", "dtype"), WEIGHTS_FIRST, ids=[f"{s.name}-{str(d).split('.')[-1]}" for s, d in WEIGHTS_FIRST]
)
def test_weights_first_matches_the_reference_on_gpu(
    scheme: Scheme, m: int, n: int, k: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode tile with y^T = W x^T and K permuted within 32 columns (the heuristic's
    choice on Hopper; forced here on any GPU), in both split-K modes, against the reference
    and against x W^T at the same tile (ragged N, M = 1 and 16)."""
    from qscheme.triton import linear as lin
    from qscheme.triton.configs import TileConfig

    generator = torch.Generator().manual_seed(m + n)
    weight = (torch.randn(n, k, generator=generator) * 0.05).to(dtype)
    canonical = canonicalize(scheme, quantize_weight(weight, scheme, **static_inputs(scheme, k)))
    device = torch.device("cuda")
    prepared = lin.prepare_weight(canonical, device)
    x = (torch.randn(m, k, generator=generator) * 2).to(dtype).to(device)
    bias = torch.randn(n, generator=generator).to(dtype).to(device)
    reference = ReferenceKernel()
    expected = reference.apply(reference.prepare(canonical, device), x.float(), bias.float()).double()
    scale = float(expected.abs().max())
    outputs = {}
    for first in (False, True):
        for mode in lin.SPLIT_K_MODES:
            monkeypatch.setenv(lin.SPLIT_K_VARIABLE, mode)
            tile = TileConfig(16, 64, 128, split_k=4, num_warps=4, num_stages=4, weights_first=first)
            actual = lin.linear(prepared, x, bias, tile)
            error = float((actual.double() - expected).abs().max())
            where = f"{scheme.name} {tile.describe()} {mode}"
            assert error <= 1e-2 * scale, f"{where}: max error {error:.3e} of {scale:.3e}"
            outputs[first, mode] = actual
    for first in (False, True):  # the split-K modes add the same partial sums in the same order
        assert torch.equal(outputs[first, "fused"], outputs[first, "two-pass"])
    apart = float((outputs[True, "fused"].double() - outputs[False, "fused"].double()).abs().max())
    assert apart <= 1e-2 * scale  # the sum's order differs, not its terms


WEIGHT_ONLY = [s for s in BUILTIN if s.activation is None]


def storable_n(scheme: Scheme, n: int, k: int) -> int:
    """``n``, or the next N the scheme's declared shapes store, still ragged for the tiles (not a
    multiple of 64) where ``n`` is: GPTQ's 2- and 3-bit zero points pack 16 or 32 columns to a word, so
    N = 1000 becomes 1008 or 1056 for them."""
    ragged = n % 64 != 0
    while check_layout(scheme, Problem(n, k)) is not None or (ragged and n % 64 == 0):
        n += 1
    return n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 4096, 4096), (3, 1000, 2304)], ids=["1x4096x4096", "3x1000x2304"])
@pytest.mark.parametrize("scheme", WEIGHT_ONLY, ids=[s.name for s in WEIGHT_ONLY])
def test_gemv_and_gemm_tiles_match_the_reference_on_gpu(
    scheme: Scheme, m: int, n: int, k: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At M <= 4 the heuristic takes the CUDA-core GEMV (qscheme.triton.gemv) with
    QSCHEME_TRITON_GEMV=1: it, and the GEMM tile the heuristic takes by default, against the
    reference, in both split-K modes (ragged N and K, M = 1 and 3)."""
    from qscheme.triton import linear as lin

    n = storable_n(scheme, n, k)
    generator = torch.Generator().manual_seed(m + n)
    weight = (torch.randn(n, k, generator=generator) * 0.05).to(dtype)
    canonical = canonicalize(scheme, quantize_weight(weight, scheme, **static_inputs(scheme, k)))
    device = torch.device("cuda")
    prepared = lin.prepare_weight(canonical, device)
    x = (torch.randn(m, k, generator=generator) * 2).to(dtype).to(device)
    bias = torch.randn(n, generator=generator).to(dtype).to(device)
    reference = ReferenceKernel()
    expected = reference.apply(reference.prepare(canonical, device), x.float(), bias.float()).double()
    scale = float(expected.abs().max())
    facts = lin._device_facts(torch.cuda.current_device())
    monkeypatch.setenv(lin.GEMV_VARIABLE, "1")
    gemv_tile = lin.heuristic_for(prepared, m, n, k, dtype, facts)
    assert gemv_tile.gemv
    monkeypatch.delenv(lin.GEMV_VARIABLE)
    gemm_tile = lin.heuristic_for(prepared, m, n, k, dtype, facts)
    assert not gemm_tile.gemv
    for tile in (gemv_tile, gemm_tile):
        for mode in lin.SPLIT_K_MODES:
            monkeypatch.setenv(lin.SPLIT_K_VARIABLE, mode)
            actual = lin.linear(prepared, x, bias, tile)
            error = float((actual.double() - expected).abs().max())
            assert error <= 1e-2 * scale, (
                f"{scheme.name} {tile.describe()} {mode}: max error {error:.3e} of {scale:.3e}"
            )


FOUR_BIT = [scheme for scheme in BUILTIN if scheme.weight.format in ("e2m1", "int4", "uint4")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("scheme", FOUR_BIT, ids=[s.name for s in FOUR_BIT])
def test_asm_decode_gives_the_pure_decoders_bits_on_gpu(
    scheme: Scheme, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """QSCHEME_TRITON_ASM_DECODE=1 (inline-PTX 4-bit decoders, qscheme.triton.asm_decode) and
    =0 (pure Triton) give the same output bits, GEMM tile and GEMV, M = 1 and 16."""
    from qscheme.triton import linear as lin
    from qscheme.triton.configs import TileConfig

    generator = torch.Generator().manual_seed(5)
    n, k = 1000, 2304
    weight = (torch.randn(n, k, generator=generator) * 0.05).to(dtype)
    canonical = canonicalize(scheme, quantize_weight(weight, scheme, **static_inputs(scheme, k)))
    device = torch.device("cuda")
    prepared = lin.prepare_weight(canonical, device)
    tiles = [
        TileConfig(16, 64, 128, split_k=4, num_warps=4, num_stages=4, weights_first=first) for first in (False, True)
    ]
    if not prepared.spec.A_QUANTIZED:
        tiles.append(TileConfig(1, 32, 256, split_k=4, num_warps=4, num_stages=1, gemv=True))
    for m in (1, 16):
        x = (torch.randn(m, k, generator=generator) * 2).to(dtype).to(device)
        for tile in tiles:
            if tile.gemv and m > tile.block_m:
                continue
            outputs = []
            for setting in ("0", "1"):
                monkeypatch.setenv(lin.ASM_DECODE_VARIABLE, setting)
                outputs.append(lin.linear(prepared, x, None, tile))
            assert torch.equal(outputs[0], outputs[1]), f"{scheme.name} {tile.describe()} m={m}: asm vs pure decode"
