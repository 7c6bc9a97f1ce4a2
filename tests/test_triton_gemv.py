"""The CUDA-core GEMV (qscheme.triton.gemv) under the interpreter, against a float64 product of
the exact emulation and the reference kernel, for every weight-only scheme the Triton kernel
claims (built-in, YAML test schemes and two 8-bit ones written here): ragged N and K, fused
partitions with different global scales, split-K in both reduction modes, bias, 3-D inputs,
16- and 32-bit inputs; and the tile heuristic's choice of it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from qscheme_plugins.reference_kernel import ReferenceKernel
from triton_samples import assert_matches, reference_output, uint8_group_scheme

from qscheme.catalog import load_catalog, load_scheme
from qscheme.descriptor import Scheme, parse_scheme_file, parse_scheme_text
from qscheme.errors import QuantizeError
from qscheme.triton import configs
from qscheme.triton import linear as lin
from qscheme.triton.configs import TileConfig
from qscheme.triton.samples import random_weight

_YAML = sorted(Path(__file__).parent.joinpath("data", "triton_schemes").glob("*.yaml"))
_EIGHT_BIT = [
    parse_scheme_text(
        """
name: test/INT8_CHANNEL_WO
weight:
  format: int8
  tensor: {name: weight, dtype: int8, shape: [N, K]}
  scale: {granularity: channel, format: fp32, stored: multiplier,
          tensor: {name: weight_scale, dtype: float32, shape: [N, 1]}}
activation: none
"""
    ),
    uint8_group_scheme(),
]
WEIGHT_ONLY: list[Scheme] = [
    s
    for s in [*load_catalog(include_plugins=False), *(parse_scheme_file(p) for p in _YAML), *_EIGHT_BIT]
    if s.activation is None and s.weight.blocks is None  # packed blocks are not the Triton kernel's
]
N, K = 72, 301  # neither a multiple of the 32-row slab nor of any K step or group


def _partitions(scheme: Scheme) -> tuple[int, ...]:
    # per-partition global scales with group or channel scales (what the reference takes)
    if scheme.weight.global_scale is not None and scheme.weight.scale.granularity in ("block", "tensor"):
        return (N,)
    return (40, N - 40)


def _check(scheme: Scheme, x: torch.Tensor, bias: torch.Tensor | None, tile: TileConfig) -> None:
    weight = random_weight(scheme, N, K, partitions=_partitions(scheme), seed=13)
    prepared = lin.prepare_weight(weight, "cpu")
    out = torch.empty(x.numel() // K, N)
    decoded = prepared.spec.A_QUANTIZED  # the pre-pass's decoded values, read like x
    segment = prepared.segments[0]
    launches = lin.gemm_launches(
        prepared, segment, x.reshape(-1, K), None, bias, out, tile, x.dtype, decoded_input=decoded
    )
    assert launches[0].kernel is lin.quantized_gemv_kernel, "the GEMV tile must launch the GEMV kernel"
    actual = lin.linear(prepared, x, bias, tile)
    assert actual.shape == (*x.shape[:-1], N) and actual.dtype == x.dtype
    assert_matches(actual, reference_output(weight, x, bias), x.dtype, f"{scheme.name} GEMV vs float64")
    reference = ReferenceKernel()
    expected = reference.apply(reference.prepare(weight, torch.device("cpu")), x, bias)
    assert_matches(actual, expected.double(), x.dtype, f"{scheme.name} GEMV vs the reference kernel")


@pytest.mark.parametrize("scheme", WEIGHT_ONLY, ids=[s.name for s in WEIGHT_ONLY])
@pytest.mark.interpreter
def test_gemv_matches_the_reference_with_split_k(scheme: Scheme) -> None:
    """M = 3 in bf16 with bias: BLOCK_M 4 (a masked input row), two 32-row slabs (the second
    ragged), K = 301 in steps of 64 split in two (a ragged last step)."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(3, K, generator=generator).to(torch.bfloat16)
    bias = torch.randn(N, generator=generator).to(torch.bfloat16)
    _check(scheme, x, bias, TileConfig(4, 32, 64, split_k=2, num_stages=1, gemv=True))


GEMV_CASES = [
    # scheme, input shape without K, dtype, tile, split-K mode
    ("compressed-tensors/NVFP4A16", (2, 2), torch.float16, TileConfig(4, 64, 128, split_k=2, gemv=True), "fused"),
    ("compressed-tensors/W4A16_ASYM", (1,), torch.float32, TileConfig(1, 32, 256, gemv=True), "two-pass"),
    ("modelopt/W4A16_AWQ", (2,), torch.bfloat16, TileConfig(2, 32, 32, split_k=4, gemv=True), "fused"),
    ("compressed-tensors/W4A16", (5,), torch.bfloat16, TileConfig(2, 64, 128, gemv=True), "two-pass"),
]


@pytest.mark.parametrize(("name", "leading", "dtype", "tile", "mode"), GEMV_CASES, ids=[c[0] for c in GEMV_CASES])
@pytest.mark.interpreter
def test_gemv_inputs_and_reductions(
    name: str,
    leading: tuple[int, ...],
    dtype: torch.dtype,
    tile: TileConfig,
    mode: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """3-D fp16 input with the fused reduction, fp32 M = 1 without split-K, AWQ's pre-scale at
    K steps of 32, and M = 5 over three row tiles of 2 (the GEMV tiles M like the GEMM)."""
    monkeypatch.setenv(lin.SPLIT_K_VARIABLE, mode)
    generator = torch.Generator().manual_seed(len(leading))
    x = torch.randn((*leading, K), generator=generator).to(dtype)
    _check(load_scheme(name), x, torch.randn(N, generator=generator).to(dtype), tile)


@pytest.mark.parametrize("name", ["compressed-tensors/W8A8", "compressed-tensors/NVFP4"])
def test_gemv_reads_activations_the_pre_pass_hands_over_decoded(name: str) -> None:
    """int8 per token (the per-token multiplier in the GEMV's epilogue) and NVFP4 W4A4: the
    pre-pass's decoded values are read like x."""
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(9))
    _check(load_scheme(name), x, None, TileConfig(2, 32, 128, split_k=2, gemv=True))


def test_gemv_refuses_quantized_activation_codes() -> None:
    scheme = load_scheme("compressed-tensors/FP8_BLOCK")  # FP8 per group: the pre-pass keeps codes
    prepared = lin.prepare_weight(random_weight(scheme, 128, 128), "cpu")
    x = torch.randn(1, 128)
    with pytest.raises(QuantizeError, match=r"GEMV tile .* quantizes its activations"):
        lin.linear(prepared, x, None, TileConfig(1, 32, 64, gemv=True))


H200 = configs.DeviceFacts("H200-like", 132, 227 * 1024, (9, 0))


def test_heuristic_keeps_the_gemm_tile_unless_the_gemv_is_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GEMV is opt-in (QSCHEME_TRITON_GEMV=1) until a GPU run shows it faster."""
    monkeypatch.delenv(lin.GEMV_VARIABLE, raising=False)
    prepared = lin.prepare_weight(random_weight(load_scheme("compressed-tensors/NVFP4A16"), 64, 64), "cpu")
    assert not lin.heuristic_for(prepared, 1, 8192, 8192, torch.bfloat16, H200).gemv
    monkeypatch.setenv(lin.GEMV_VARIABLE, "0")
    assert not lin.heuristic_for(prepared, 1, 8192, 8192, torch.bfloat16, H200).gemv


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 16])
def test_heuristic_takes_the_gemv_at_the_smallest_m(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(lin.GEMV_VARIABLE, "1")
    scheme = load_scheme("compressed-tensors/NVFP4A16")
    prepared = lin.prepare_weight(random_weight(scheme, 64, 64), "cpu")
    tile = lin.heuristic_for(prepared, m, 8192, 8192, torch.bfloat16, H200)
    assert tile.gemv == (m <= configs.GEMV_MAX_M)
    if tile.gemv:
        assert tile.block_m >= m and tile.block_m == configs.m_bucket(m)
        # every SM streams weights: at least four programs per multiprocessor
        assert configs.cdiv(8192, tile.block_n) * tile.split_k >= 4 * H200.multiprocessors
        assert tile.block_k * prepared.weight_bits // 8 == 128  # one cache line of each row per step
    else:
        assert tile.block_m == 16
    # the config cache keys M by bucket: the GEMV's M never shares a key with the GEMM's
    assert (configs.m_bucket(m) <= configs.GEMV_MAX_M) == (m <= configs.GEMV_MAX_M)


def test_heuristic_keeps_the_gemm_where_the_gemv_does_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(lin.GEMV_VARIABLE, "1")  # asked for, and still not taken
    w4a4 = lin.prepare_weight(random_weight(load_scheme("compressed-tensors/NVFP4"), 64, 64), "cpu")
    assert not lin.heuristic_for(w4a4, 1, 8192, 8192, torch.bfloat16, H200).gemv  # activation codes
    w4a16 = lin.prepare_weight(random_weight(load_scheme("compressed-tensors/W4A16"), 64, 64), "cpu")
    assert not lin.heuristic_for(w4a16, 1, 8192, 8192, torch.float32, H200).gemv  # 32-bit inputs
    small = lin.heuristic_for(w4a16, 1, 256, 512, torch.bfloat16, H200)
    assert small.gemv and small.split_k == 1  # K of two steps: nothing to split
    g48 = lin.prepare_weight(random_weight(parse_scheme_file(_YAML[2]), 64, 96), "cpu")
    assert lin.heuristic_for(g48, 2, 4096, 4096, torch.bfloat16, H200).block_k == 64  # gathered groups
