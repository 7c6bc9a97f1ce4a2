"""quantize_weight with ModelOpt's rules: its conventions, round trips within half a step, the
canonical equivalence of ModelOpt and compressed-tensors NVFP4, and (where a Python with
nvidia-modelopt is named by QSCHEME_MODELOPT_PYTHON) bit-identity with ModelOpt itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from quantize_bounds import assert_within_half_a_step
from torch import Tensor

from qscheme.canonical import canonicalize
from qscheme.catalog import load_scheme
from qscheme.dequantize import dequantize_weight
from qscheme.formats import decode, unpack_fp4_k, unpack_int4_n
from qscheme.quantize import quantize_weight

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _weight(n: int, k: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0, scale: float = 0.05) -> Tensor:
    return (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _group_absmax(weight: Tensor, group: int) -> Tensor:
    return weight.float().abs().reshape(weight.shape[0], -1, group).amax(-1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_weight_scale_2_is_a_multiplier_equal_to_amax_over_2688(dtype: torch.dtype) -> None:
    weight = _weight(64, 128, dtype)
    tensors = quantize_weight(weight, "modelopt/NVFP4")
    assert set(tensors) == {"weight", "weight_scale", "weight_scale_2"}
    scale_2 = tensors["weight_scale_2"]
    assert scale_2.dtype == torch.float32 and scale_2.shape == ()
    amax = weight.abs().max().float()
    assert torch.equal(scale_2, amax / 2688.0)
    # block scale: e4m3(amax_block / (6 * weight_scale_2)), a multiplier
    expected = (_group_absmax(weight, 16) / (6.0 * scale_2)).clamp(2**-9, 448).to(torch.float8_e4m3fn)
    assert torch.equal(tensors["weight_scale"].view(torch.uint8), expected.view(torch.uint8))
    # w ~ fp4 * weight_scale * weight_scale_2
    values = decode(unpack_fp4_k(tensors["weight"], 128), "e2m1")
    rebuilt = values * (tensors["weight_scale"].float() * scale_2).repeat_interleave(16, dim=1)
    assert torch.equal(rebuilt, dequantize_weight(tensors, "modelopt/NVFP4"))


def test_w4a8_nvfp4_fp8_weight_scale_2_is_amax_over_448_with_groups_of_32() -> None:
    weight = _weight(32, 96)
    tensors = quantize_weight(weight, "modelopt/W4A8_NVFP4_FP8")
    assert torch.equal(tensors["weight_scale_2"], weight.abs().max().float() / 448.0)
    assert tensors["weight_scale"].shape == (32, 3)
    # element x block scale stays within FP8's range: block scales are at most 448 / 6
    assert float(tensors["weight_scale"].float().max()) <= 448.0 / 6.0 + 4.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_scale_is_amax_over_448_and_a_bf16_weight_is_divided_in_its_own_dtype(dtype: torch.dtype) -> None:
    weight = _weight(40, 72, dtype, seed=2)
    tensors = quantize_weight(weight, "modelopt/FP8")
    scale = tensors["weight_scale"]
    assert scale.dtype == torch.float32 and scale.shape == ()
    assert torch.equal(scale, torch.tensor(float(weight.abs().max()) / 448.0))
    # the exporter's (weight / scale).to(e4m3) with a 0-dim float32 scale keeps the weight's dtype
    expected = (weight / scale).to(torch.float8_e4m3fn)
    assert torch.equal(tensors["weight"].view(torch.uint8), expected.view(torch.uint8))


def test_int4_awq_packs_signed_nibbles_along_n_with_amax_over_7_scales() -> None:
    weight = _weight(16, 256, seed=4)
    tensors = quantize_weight(weight, "modelopt/W4A16_AWQ")
    assert tensors["weight"].shape == (8, 256) and tensors["weight"].dtype == torch.uint8
    scale = tensors["weight_scale"]
    assert scale.dtype == torch.float32 and torch.equal(scale, _group_absmax(weight, 128) / 7.0)
    values = unpack_int4_n(tensors["weight"], 16)
    expected = (weight / scale.repeat_interleave(128, dim=1)).round().clamp(-8, 7).to(torch.int8)
    assert torch.equal(values, expected)


def test_fp8_per_block_scales_are_stored_as_blocks_n_1_blocks_k_1() -> None:
    weight = _weight(200, 300, torch.float32, seed=6)
    tensors = quantize_weight(weight, "modelopt/fp8_pb_wo")
    assert tensors["weight_scale"].shape == (2, 1, 3, 1)
    padded = torch.nn.functional.pad(weight, (0, 84, 0, 56))
    amax = padded.abs().reshape(2, 128, 3, 128).amax(dim=(1, 3))
    assert torch.equal(tensors["weight_scale"].reshape(2, 3), amax / 448.0)


def test_mxfp4_rounds_ties_toward_zero_like_modelopts_cast() -> None:
    # one group of 32: amax 6 gives exponent 0, so the elements are their own scaled values
    values = torch.tensor([6.0, 0.75, -0.75, 1.25, 2.5, 3.5, 5.0, 0.25] + [0.0] * 24).reshape(1, 32)
    tensors = quantize_weight(values, "modelopt/mxfp4")
    assert int(tensors["weight_scale"]) == 127
    codes = unpack_fp4_k(tensors["weight"], 32)[0, :8].tolist()
    # 0.75 -> 0.5, 1.25 -> 1.0, 2.5 -> 2.0, 3.5 -> 3.0, 5.0 -> 4.0: ties go down
    assert codes == [7, 1, 9, 2, 4, 5, 6, 0]
    assert set(unpack_fp4_k(tensors["weight"], 32)[0, 8:].tolist()) == {8}  # +0.0 carries the sign bit
    compressed_tensors = quantize_weight(values, "compressed-tensors/MXFP4")
    assert unpack_fp4_k(compressed_tensors["weight_packed"], 32)[0, :8].tolist() == [7, 2, 10, 2, 4, 6, 6, 0]


@pytest.mark.parametrize(
    "scheme",
    [
        "modelopt/NVFP4",
        "modelopt/W4A16_NVFP4",
        "modelopt/W4A8_NVFP4_FP8",
        "modelopt/mxfp4",
        "modelopt/FP8",
        "modelopt/fp8_pb_wo",
        "modelopt/W4A16_AWQ",
    ],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trips_stay_within_half_a_step(scheme: str, dtype: torch.dtype) -> None:
    weight = _weight(128, 256, dtype, seed=8)
    assert_within_half_a_step(scheme, weight, quantize_weight(weight, scheme))


def test_modelopt_and_compressed_tensors_nvfp4_are_one_canonical_layer() -> None:
    weight = _weight(48, 64, seed=9)
    ct = quantize_weight(weight, "compressed-tensors/NVFP4")
    # the same codes and block scales under ModelOpt's names, the global scale as its multiplier
    modelopt = {
        "weight": ct["weight_packed"],
        "weight_scale": ct["weight_scale"],
        "weight_scale_2": torch.reciprocal(ct["weight_global_scale"]).reshape(()),
    }
    ours = canonicalize(load_scheme("compressed-tensors/NVFP4"), ct).kernel_tensors()
    theirs = canonicalize(load_scheme("modelopt/NVFP4"), modelopt).kernel_tensors()
    assert set(ours) == set(theirs)
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype, name
        assert torch.equal(ours[name].view(torch.uint8), theirs[name].view(torch.uint8)), name


# --- ModelOpt itself, where available ----------------------------------------------------------

MODELOPT_PYTHON = os.environ.get("QSCHEME_MODELOPT_PYTHON")


@pytest.mark.skipif(not MODELOPT_PYTHON, reason="set QSCHEME_MODELOPT_PYTHON to a Python with nvidia-modelopt")
@pytest.mark.oracle
def test_bit_identical_with_modelopt_export_and_dequantize(tmp_path: Path) -> None:
    """Bit identity holds on any CPU: both sides get the same weights (made here, seeded) and do
    only exact arithmetic on them, on this machine: amax (a max, order-free), one IEEE division
    or multiplication per scale, round to nearest per element, bit packing. MXFP4's exponent is
    ``ceil(log2(amax / 6))`` on both sides: torch's log2 is not correctly rounded (its vector and
    scalar paths may differ by an ulp next to an integer), but both sides evaluate it with the
    same torch kernel over the same contiguous blocks, so they agree on any one machine."""
    assert MODELOPT_PYTHON is not None
    algorithms = {
        "NVFP4": 16,
        "W4A16_NVFP4": 16,
        "W4A8_NVFP4_FP8": 32,
        "FP8": 1,
        "fp8_pb_wo": 1,
        "W4A16_AWQ": 128,
        "mxfp4": 32,
    }
    cases = []
    generator = torch.Generator().manual_seed(11)
    for algorithm, multiple in algorithms.items():
        for dtype in DTYPES:
            n = 2 * int(torch.randint(1, 80, (), generator=generator))
            k = multiple * int(torch.randint(1, 5, (), generator=generator)) if multiple > 1 else 200
            magnitude = float(torch.empty(()).uniform_(-5, 2, generator=generator))  # seeded: reproducible
            weight = torch.randn(n, k, generator=generator) * 10.0**magnitude
            weight[: n // 4, : k // 2] = 0.0
            cases.append((algorithm, weight.to(dtype)))
    torch.save(cases, tmp_path / "in.pt")
    oracle = Path(__file__).with_name("modelopt_oracle.py")
    subprocess.run([MODELOPT_PYTHON, str(oracle), str(tmp_path / "in.pt"), str(tmp_path / "out.pt")], check=True)
    for (algorithm, weight), (reference, dequantized) in zip(cases, torch.load(tmp_path / "out.pt"), strict=True):
        scheme = f"modelopt/{algorithm}"
        ours = quantize_weight(weight, scheme)
        for name, expected in reference.items():
            got = ours[name]
            assert got.dtype == expected.dtype, (scheme, name)
            expected = expected.reshape(-1).contiguous().view(torch.uint8)
            assert torch.equal(got.reshape(-1).contiguous().view(torch.uint8), expected), (scheme, name)
        if dequantized is not None:  # ModelOpt decodes MXFP4's zero codes to -0.0, we to +0.0
            assert torch.equal(dequantize_weight(ours, scheme) + 0.0, dequantized + 0.0), scheme


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__]))
