"""quantize_weight / dequantize_weight against compressed-tensors itself, bit for bit.

For every built-in compressed-tensors scheme and random weights (float32, bfloat16, float16;
shapes that are not multiples of the block where the scheme allows them; groups of zeros and
negative zeros), the tensors quantize_weight writes equal those the library's own path writes
(tests/ct_reference.py), and dequantize_weight equals the library's float32 decompression.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor

pytest.importorskip("compressed_tensors")

from ct_reference import ct_dequantize_float32, ct_quantize

from qscheme.catalog import load_scheme
from qscheme.dequantize import dequantize_weight
from qscheme.descriptor import Scheme
from qscheme.quantize import quantize_weight

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# preset -> (K must be a multiple of, N must be a multiple of): the library's own limits
PRESETS = {
    "NVFP4": (16, 1),
    "NVFP4A16": (16, 1),
    "MXFP4": (32, 1),
    "MXFP4A16": (32, 1),
    "W4A16": (128, 1),
    "W4A16_ASYM": (128, 1),
    "W8A8": (1, 1),
    "FP8": (1, 1),
    "FP8_DYNAMIC": (1, 1),
    "FP8_BLOCK": (1, 1),  # edge blocks are zero-padded
}


def _bits(tensor: Tensor) -> Tensor:
    """A tensor's bytes as integers, so that comparisons are bitwise (NaN and -0.0 included)."""
    if tensor.dtype.itemsize == 1:
        return tensor.view(torch.uint8)
    return tensor.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.dtype.itemsize])


def assert_same_tensors(ours: dict[str, Tensor], reference: dict[str, Tensor]) -> None:
    assert set(ours) == set(reference), (sorted(ours), sorted(reference))
    for name, expected in reference.items():
        got = ours[name]
        assert got.dtype == expected.dtype, (name, got.dtype, expected.dtype)
        assert got.shape == expected.shape, (name, tuple(got.shape), tuple(expected.shape))
        different = _bits(got) != _bits(expected)
        assert not bool(different.any()), (
            f"{name}: {int(different.sum())} values differ, first at "
            f"{tuple(different.nonzero()[0].tolist())}: ours {got[different][0]}, library {expected[different][0]}"
        )


def assert_same_weights(ours: Tensor, reference: Tensor) -> None:
    """Bitwise equal, except that e2m1's negative zero decodes to +0.0 here and -0.0 there."""
    assert ours.dtype == reference.dtype == torch.float32
    assert torch.equal(_bits(ours + 0.0), _bits(reference + 0.0))
    nonzero = reference != 0
    assert torch.equal(_bits(ours[nonzero]), _bits(reference[nonzero]))


@st.composite
def weights(draw: st.DrawFn, preset: str) -> Tensor:
    k_multiple, n_multiple = PRESETS[preset]
    n = draw(st.integers(1, 40)) * n_multiple
    if k_multiple > 1:
        k = draw(st.integers(1, 4)) * k_multiple
    else:
        k = draw(st.integers(1, 300))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    exponent = draw(st.floats(-9, 4))  # magnitudes from ~1e-9 (fp16 underflow) to ~1e4
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator) * 10.0**exponent
    special = draw(st.sampled_from(("none", "zero rows", "zero block", "negative zeros", "one outlier", "positive")))
    if special == "zero rows":
        weight[: n // 2] = 0.0
    elif special == "zero block":
        weight[: (n + 1) // 2, : (k + 1) // 2] = 0.0
    elif special == "negative zeros":
        weight[::2] = -0.0
    elif special == "one outlier":
        weight[0, -1] = 10.0 ** (exponent + 3)
    elif special == "positive":
        weight = weight.abs()  # asymmetric ranges with a minimum above zero
    largest = torch.finfo(dtype).max / 2
    return weight.clamp(-largest, largest).to(dtype)  # finite in every dtype


@functools.cache
def _scheme(preset: str) -> Scheme:
    return load_scheme(f"compressed-tensors/{preset}")


def _check(preset: str, weight: Tensor, **given: Tensor) -> None:
    scheme = _scheme(preset)
    reference, ct_scheme = ct_quantize(weight, preset, global_scale=given.get("weight_global_scale"))
    ours = quantize_weight(weight, scheme, **given)
    # static activation scales are left out unless given: compare the weight's tensors
    reference = {name: value for name, value in reference.items() if not name.startswith("input_")}
    assert_same_tensors(ours, reference)
    assert_same_weights(dequantize_weight(ours, scheme), ct_dequantize_float32(reference, ct_scheme))


@pytest.mark.parametrize("preset", sorted(PRESETS))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_quantize_and_dequantize_match_compressed_tensors(preset: str, data: st.DataObject) -> None:
    _check(preset, data.draw(weights(preset)))


@pytest.mark.parametrize("preset", ["NVFP4", "NVFP4A16"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_given_global_scale_is_used_as_the_library_uses_it(preset: str, dtype: torch.dtype) -> None:
    # llm-compressor shares one global scale over q/k/v: a layer quantized with another's
    weight = (torch.randn(48, 64, generator=torch.Generator().manual_seed(3)) * 0.05).to(dtype)
    shared = torch.tensor([1234.5], dtype=torch.float32)
    _check(preset, weight, weight_global_scale=shared)
    ours = quantize_weight(weight, f"compressed-tensors/{preset}", weight_global_scale=shared)
    assert torch.equal(ours["weight_global_scale"], shared)


@pytest.mark.parametrize("preset", ["NVFP4", "NVFP4A16"])
def test_a_float16_weight_of_small_absmax_gets_the_librarys_global_scale_of_one(preset: str) -> None:
    """generate_gparam computes 448 * 6 / absmax in the weight's dtype: below absmax 2688 / 65504
    it overflows float16 and becomes 1.0 (nan_to_num). qscheme writes the same tensors, bit for
    bit (documented in qscheme.producers.compressed_tensors.arithmetic), and the float32 weight gets the
    library's float32 global scale."""
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(0)) * 0.004
    half = weight.to(torch.float16)
    _check(preset, half)
    assert float(quantize_weight(half, _scheme(preset))["weight_global_scale"]) == 1.0
    _check(preset, half.float())
    expected = 2688.0 / float(half.float().abs().max())
    assert float(quantize_weight(half.float(), _scheme(preset))["weight_global_scale"]) == pytest.approx(expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_block_edges_are_padded_like_the_library(dtype: torch.dtype) -> None:
    weight = (torch.randn(130, 257, generator=torch.Generator().manual_seed(5)) * 3).to(dtype)
    _check("FP8_BLOCK", weight)
    assert quantize_weight(weight, "compressed-tensors/FP8_BLOCK")["weight_scale"].shape == (2, 3)


def test_bf16_scales_are_stored_in_bf16_and_the_nvfp4_global_scale_keeps_bf16_precision() -> None:
    weight = torch.randn(32, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    fp8 = quantize_weight(weight, "compressed-tensors/FP8_DYNAMIC")
    assert fp8["weight_scale"].dtype == torch.bfloat16
    nvfp4 = quantize_weight(weight, "compressed-tensors/NVFP4")
    global_scale = nvfp4["weight_global_scale"]
    assert global_scale.dtype == torch.float32
    # generate_gparam's `448 * 6 / amax` in bfloat16; torch evaluates a number over a tensor as
    # reciprocal(amax) * 2688, two bfloat16 roundings; then widened to float32
    assert float(global_scale) == float(torch.reciprocal(weight.abs().max()) * 2688.0)
    assert float(global_scale) == float(global_scale.to(torch.bfloat16))


def test_static_input_scales_are_written_only_when_given() -> None:
    weight = torch.randn(16, 32)
    scheme = "compressed-tensors/FP8"
    assert "input_scale" not in quantize_weight(weight, scheme)
    with_input = quantize_weight(weight.to(torch.bfloat16), scheme, input_scale=torch.tensor([0.02]))
    # the module's input_scale parameter has the weight's dtype
    assert with_input["input_scale"].dtype == torch.bfloat16 and with_input["input_scale"].shape == (1,)
    nvfp4 = quantize_weight(weight, "compressed-tensors/NVFP4", input_global_scale=torch.tensor(448.0 * 6 / 3))
    assert nvfp4["input_global_scale"].dtype == torch.float32 and nvfp4["input_global_scale"].shape == (1,)


def test_quantize_does_not_touch_the_weight() -> None:
    weight = torch.randn(8, 32)  # float32: observed without a copy
    before = weight.clone()
    for scheme in ("compressed-tensors/NVFP4", "compressed-tensors/FP8_BLOCK", "modelopt/mxfp4"):
        quantize_weight(weight, scheme)
    assert torch.equal(weight, before)
