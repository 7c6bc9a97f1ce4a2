"""convert_deviation: the fast per-layer deviation equals the full dequantized comparison.

``weight_deviation`` evaluates (triple, code) tables and finds which pairs occur without
dequantizing; ``full_deviation`` dequantizes both sides over every element. Random layers of
several schemes (NVFP4 with global scales whose inverse rounds, fl(1/fl(1/x)) != x; int4 with
zero points and a ragged last group; FP8 per channel; FP8 blocks; odd K), with their worst
codes sometimes absent, must give the same figures both ways, and both ways must agree with
an element-by-element reference computed here from ``dequantize``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from qscheme.canonical import CanonicalWeight, canonicalize, dequantize
from qscheme.catalog import load_scheme
from qscheme.quantize import quantize_weight
from qscheme.writing import convert_deviation
from qscheme.writing.convert_deviation import full_deviation, ulp_distance, weight_deviation
from qscheme.writing.convert_layer import convert_layer


def reference(a: CanonicalWeight, b: CanonicalWeight) -> tuple[int, float]:
    """The figures from the two dequantized weights, element by element."""
    x, y = dequantize(a), dequantize(b)
    return int(ulp_distance(x, y).max()), float((x - y).abs().max())


def does_not_round_trip(near: float) -> torch.Tensor:
    """The first float32 at or above ``near`` with fl(1/fl(1/x)) != x, as a [1] tensor."""
    start = torch.tensor([near], dtype=torch.float32).view(torch.int32)
    candidates = (start + torch.arange(1 << 22, dtype=torch.int32)).view(torch.float32)
    moved = torch.reciprocal(torch.reciprocal(candidates)) != candidates
    return candidates[moved][:1].clone()


def layer(scheme_name: str, n: int, k: int, seed: int, **given: torch.Tensor) -> tuple[CanonicalWeight, dict]:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator) * torch.rand(n, 1, generator=generator) * 3
    scheme = load_scheme(scheme_name)
    tensors = quantize_weight(weight, scheme, **given)
    return canonicalize(scheme, tensors, n, k), tensors


def perturbed_scale(weight: CanonicalWeight, seed: int) -> CanonicalWeight:
    """The same codes with about half the scales moved by one step of their own dtype."""
    generator = torch.Generator().manual_seed(seed)
    scale = weight.scale
    moved = torch.rand(scale.shape, generator=generator) < 0.5
    if scale.dtype.itemsize == 1:
        raw = scale.view(torch.uint8)
        bumped = torch.where(moved & (raw & 0x7F < 0x7E) & (raw & 0x7F > 1), raw + 1, raw)
        return replace(weight, scale=bumped.view(scale.dtype))
    wide = scale.to(torch.float32)
    bumped = torch.where(moved, torch.nextafter(wide, torch.full_like(wide, float("inf"))), wide)
    return replace(weight, scale=bumped.to(scale.dtype))


def thinned(weight: CanonicalWeight, keep: int) -> CanonicalWeight:
    """The same layer with only code bits ``keep`` kept: its worst codes may be absent."""
    if weight.codes.dtype == torch.uint8:
        return replace(weight, codes=weight.codes & keep)
    raw = weight.codes.view(torch.uint8) & keep
    return replace(weight, codes=raw.view(weight.codes.dtype))


def same_figures(a: CanonicalWeight, b: CanonicalWeight) -> tuple[int, float]:
    fast, full = weight_deviation(a, b), full_deviation(a, b)
    assert (fast.max_ulps, fast.max_abs_error) == (full.max_ulps, full.max_abs_error)
    assert (fast.max_ulps, fast.max_abs_error) == reference(a, b)
    return fast.max_ulps, fast.max_abs_error


@pytest.mark.parametrize("seed", range(4))
def test_nvfp4_inverted_global_scales_that_round(seed: int) -> None:
    """compressed-tensors NVFP4A16 -> ModelOpt W4A16_NVFP4 through convert_layer, global scales chosen
    so that fl(1/fl(1/x)) != x; with all codes, then with the worst ones thinned out."""
    source = load_scheme("compressed-tensors/NVFP4A16")
    target = load_scheme("modelopt/W4A16_NVFP4")
    n, k = 48, 96
    divisor = does_not_round_trip(150.0 * (seed + 1))
    assert not torch.equal(torch.reciprocal(torch.reciprocal(divisor)), divisor)
    original, tensors = layer(source.name, n, k, seed, weight_global_scale=divisor)
    result = convert_layer("m", source, target, tensors)
    converted = canonicalize(target, result.tensors, n, k)
    ulps, _ = same_figures(original, converted)
    assert ulps == result.max_ulps and ulps > 0
    for keep in (0x11, 0x33, 0x77, 0x99):
        same_figures(thinned(original, keep), thinned(converted, keep))


@pytest.mark.parametrize(
    ("scheme", "n", "k"),
    [
        ("compressed-tensors/NVFP4A16", 32, 64),
        ("compressed-tensors/W4A16_ASYM", 24, 256),  # zero points
        ("compressed-tensors/W4A16", 8, 256),
        ("compressed-tensors/FP8", 32, 48),  # e4m3 per channel
        ("compressed-tensors/FP8_BLOCK", 256, 256),  # 128x128 blocks: the counting pass
        ("compressed-tensors/MXFP4A16", 16, 64),
    ],
)
@pytest.mark.parametrize("seed", range(3))
def test_random_scales_same_as_full_comparison(scheme: str, n: int, k: int, seed: int) -> None:
    source, _ = layer(scheme, n, k, seed)
    target = perturbed_scale(source, seed + 10)
    assert same_figures(source, target)[0] > 0
    same_figures(target, source)
    for keep in (0x11, 0x70, 0x0F):
        same_figures(thinned(source, keep), thinned(target, keep))


def cut(weight: CanonicalWeight, n: int, k: int) -> CanonicalWeight:
    """The layer's first n rows and k columns: a ragged last group or block, an odd K."""
    columns = -(-k // 2) if weight.codes.dtype == torch.uint8 and weight.scheme.weight.format != "uint8" else k
    codes = weight.codes[:n, :columns].clone()
    if columns != k and k % 2:
        codes[:, -1] &= 0x0F
    tile_rows, tile_columns = convert_deviation.scale_tile(weight, weight.scale)
    rows = n if weight.scale.shape[0] == weight.n else -(-n // tile_rows)
    scale = weight.scale[:rows, : -(-k // tile_columns)] if weight.scale.ndim == 2 else weight.scale
    zero = None if weight.zero_point is None else weight.zero_point[:n, : scale.shape[1]]
    return replace(weight, n=n, k=k, codes=codes, scale=scale, zero_point=zero, partitions=(n,))


@pytest.mark.parametrize(
    ("scheme", "n", "k"),
    [
        ("compressed-tensors/NVFP4A16", 16, 40),  # ragged last group
        ("compressed-tensors/NVFP4A16", 16, 39),  # odd K: nibbles unpacked
        ("compressed-tensors/W4A16_ASYM", 24, 200),  # zero points, ragged last group
        ("compressed-tensors/FP8_BLOCK", 200, 136),  # ragged blocks
    ],
)
@pytest.mark.parametrize("seed", range(2))
def test_ragged_layers_same_as_full_comparison(scheme: str, n: int, k: int, seed: int) -> None:
    whole, _ = layer(scheme, 256, 256, seed)
    source = cut(whole, n, k)
    target = cut(perturbed_scale(whole, seed + 20), n, k)
    same_figures(source, target)
    same_figures(target, source)
    for keep in (0x11, 0x70, 0x0F):
        same_figures(thinned(source, keep), thinned(target, keep))


def test_the_counting_pass_gives_the_same_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the search's budget exhausted at once, the bincount pass takes over."""
    source, _ = layer("compressed-tensors/NVFP4A16", 64, 128, 7)
    target = perturbed_scale(source, 8)
    expected = reference(source, target)
    monkeypatch.setattr(convert_deviation, "_row_tiles", lambda *args: None)
    for keep in (0xFF, 0x33):
        a, b = thinned(source, keep), thinned(target, keep)
        fast = weight_deviation(a, b)
        assert (fast.max_ulps, fast.max_abs_error) == reference(a, b)
    assert expected[0] > 0


def test_the_search_without_its_sample_gives_the_same_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sample only shortcuts the search: with it finding nothing, every triple's tiles are searched."""
    source, _ = layer("compressed-tensors/NVFP4A16", 64, 128, 11)
    target = perturbed_scale(source, 8)
    sampled = [0]

    def nothing(*args: object) -> bool:
        sampled[0] += 1
        return False

    monkeypatch.setattr(convert_deviation, "_sampled_hit", nothing)
    for keep in (0xFF, 0x33, 0x70):
        a, b = thinned(source, keep), thinned(target, keep)
        fast = weight_deviation(a, b)
        assert (fast.max_ulps, fast.max_abs_error) == reference(a, b)
    assert sampled[0] > 0


def test_identical_scales_give_zero_and_shapes_must_match() -> None:
    source, _ = layer("compressed-tensors/NVFP4A16", 16, 32, 1)
    assert weight_deviation(source, source).max_ulps == 0
    other, _ = layer("compressed-tensors/NVFP4A16", 16, 64, 1)
    with pytest.raises(ValueError, match="different shapes"):
        weight_deviation(source, other)
