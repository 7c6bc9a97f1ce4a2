"""Marlin operand layouts (qscheme_plugins.marlin_layout), checked bit for bit against vLLM.

vLLM's own prepare code runs in a side venv named by QSCHEME_VLLM_PYTHON (built by
scripts/install-vllm-oracle.sh) through tests/vllm_oracle.py: its FP4 and FP8 prepare functions
and its compressed-tensors Marlin kernel's weight processing, with the CUDA repack op replaced by
vLLM's Python equivalent from its Marlin test utilities. Every case goes out in one subprocess
call. Without QSCHEME_VLLM_PYTHON those tests skip; in CI (``CI`` set) a missing oracle fails.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from kernel_fakes import builtin_scheme
from qscheme_plugins import marlin_layout as ml
from torch import Tensor

from qscheme.canonical import CanonicalWeight, stored_zero_points
from qscheme.descriptor import Scheme, parse_scheme_text
from qscheme.errors import UsageError
from qscheme.formats import pack_int32_k
from qscheme.triton.samples import random_weight

VLLM_PYTHON = os.environ.get("QSCHEME_VLLM_PYTHON")
ORACLE = Path(__file__).with_name("vllm_oracle.py")
needs_vllm = pytest.mark.skipif(
    not VLLM_PYTHON,
    reason="set QSCHEME_VLLM_PYTHON to a Python with vLLM (scripts/install-vllm-oracle.sh builds .venv-vllm)",
)
DTYPES = (torch.bfloat16, torch.float16)


def int_scheme(element: str, group: int | None, zero_points: bool) -> Scheme:
    """A compressed-tensors pack-quantized int scheme: groups of ``group`` along K, or channel scales."""
    bits = 4 if element == "int4" else 8
    columns = f"ceil(K/{group})" if group else "1"
    granularity = f"granularity: group, group_size: {group}" if group else "granularity: channel"
    zero = (
        f"\n  zero_point: {{format: {element}, packing: int32_n,"
        f' tensor: {{name: weight_zero_point, dtype: int32, shape: ["ceil(N/{32 // bits})", "{columns}"]}}}}'
        if zero_points
        else ""
    )
    return parse_scheme_text(
        f"""
name: test/{element}_{"g" + str(group) if group else "channel"}{"_zp" if zero_points else ""}
weight:
  format: {element}
  packing: int32_k
  tensor: {{name: weight_packed, dtype: int32, shape: [N, "ceil(K/{32 // bits})"]}}
  scale: {{{granularity}, format: float, stored: multiplier,
          tensor: {{name: weight_scale, dtype: bfloat16, shape: [N, "{columns}"]}}}}{zero}
activation: none
"""
    )


def signed_values(weight: CanonicalWeight) -> Tensor:
    """int4 / int8 canonical codes -> their signed values [N, K]."""
    codes = weight.codes.view(torch.uint8).to(torch.int16)
    if weight.scheme.weight.format == "int8":
        return weight.codes.to(torch.int16)
    nibbles = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2)[:, : weight.k]
    return ((nibbles ^ 8) - 8).to(torch.int16)


@dataclass(frozen=True)
class Case:
    """One layer: its canonical weight, the activation dtype, a bias, and vLLM's inputs."""

    name: str
    weight: CanonicalWeight
    dtype: torch.dtype
    bias: Tensor | None
    oracle: dict[str, Any]


def _case(name: str, weight: CanonicalWeight, dtype: torch.dtype, with_bias: bool) -> Case:
    n, k = weight.n, weight.k
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n * k)).to(dtype) if with_bias else None
    spec = weight.scheme.weight
    common: dict[str, Any] = {"n": n, "k": k, "dtype": dtype, "bias": bias}
    if spec.format == "e2m1":  # compressed-tensors after its load step: global scale as a multiplier
        global_scale = None if weight.global_scale is None else weight.global_scale[0].clone()
        oracle = {"path": "fp4", "weight": weight.codes, "weight_scale": weight.scale, "global_scale": global_scale}
    elif spec.format == "e4m3":
        block = None
        scale = weight.scale
        if spec.scale.granularity == "block":
            assert spec.scale.block is not None
            block = list(spec.scale.block)
        oracle = {"path": "fp8", "weight": weight.codes, "weight_scale": scale, "block": block}
        oracle["partitions"] = list(weight.partitions)
    else:
        bits = 4 if spec.format == "int4" else 8
        group = spec.scale.group_size if spec.scale.granularity == "group" else -1
        oracle = {
            "path": "int",
            "bits": bits,
            "group_size": group,
            "weight_packed": pack_int32_k(signed_values(weight), bits),
            "weight_scale": weight.scale.to(dtype),
        }
        if weight.zero_point is not None:
            oracle["weight_zero_point"] = stored_zero_points(weight.scheme, weight.zero_point)
    return Case(name, weight, dtype, bias, {**common, **oracle})


def _cases() -> list[Case]:
    cases = []
    dtype_names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    nvfp4 = builtin_scheme("compressed-tensors/NVFP4A16")
    mxfp4 = builtin_scheme("compressed-tensors/MXFP4A16")
    for dtype in DTYPES:
        d = dtype_names[dtype]
        for n, k in ((128, 256), (96, 272), (200, 512)):
            weight = random_weight(nvfp4, n, k, seed=n + k)
            cases.append(_case(f"nvfp4-{n}x{k}-{d}", weight, dtype, with_bias=n == 96))
        # scales normalized to 448 (as producers write them): no rescaling factor
        weight = random_weight(nvfp4, 64, 128, seed=5)
        scale = weight.scale.float()
        cases.append(
            _case(
                f"nvfp4-max448-{d}",
                replace(weight, scale=(scale * 448 / scale.max()).to(torch.float8_e4m3fn)),
                dtype,
                False,
            )
        )
        for n, k in ((64, 256), (72, 224)):
            cases.append(_case(f"mxfp4-{n}x{k}-{d}", random_weight(mxfp4, n, k, seed=n), dtype, with_bias=n == 72))
    for zero_points in (False, True):
        for group in (32, 64, 128, None):
            scheme = int_scheme("int4", group, zero_points)
            shapes = ((128, 256), (96, 384), (200, 512)) if group else ((128, 256), (96, 200))
            for n, k in shapes:
                for dtype in DTYPES:
                    name = f"{scheme.name.split('/')[1]}-{n}x{k}-{dtype_names[dtype]}"
                    weight = random_weight(scheme, n, k, seed=n * 7 + k)
                    cases.append(_case(name, weight, dtype, with_bias=n == 96))
    for group in (128, None):
        scheme = int_scheme("int8", group, False)
        for n, k in ((128, 256), (96, 384)):
            for dtype in DTYPES:
                weight = random_weight(scheme, n, k, seed=n + 3)
                cases.append(_case(f"{scheme.name.split('/')[1]}-{n}x{k}-{dtype_names[dtype]}", weight, dtype, n == 96))
    fp8_tensor = builtin_scheme("compressed-tensors/FP8")
    fp8_channel = builtin_scheme("compressed-tensors/FP8_DYNAMIC")
    fp8_block = builtin_scheme("modelopt/fp8_pb_wo")
    for dtype in DTYPES:
        d = dtype_names[dtype]
        cases.append(_case(f"fp8-tensor-128x256-{d}", random_weight(fp8_tensor, 128, 256, seed=1), dtype, False))
        fused = random_weight(fp8_tensor, 192, 128, partitions=(64, 128), seed=2)
        cases.append(_case(f"fp8-tensor-fused-{d}", fused, dtype, True))
        cases.append(_case(f"fp8-channel-80x200-{d}", random_weight(fp8_channel, 80, 200, seed=3), dtype, True))
        cases.append(_case(f"fp8-block-200x384-{d}", random_weight(fp8_block, 200, 384, seed=4), dtype, False))
    return cases


CASES = _cases()


def _helper_inputs() -> dict[str, Any]:
    """Inputs for vLLM's single helpers (what the prepare paths do not reach on their own)."""
    generator = torch.Generator().manual_seed(0)
    shapes = [
        (n, k, g)
        for n in (1, 63, 64, 65, 96, 128, 200, 4096)
        for k in (16, 100, 128, 192, 4000)
        for g in (-1, 16, 32, 128)
    ]
    scales = torch.rand(8, 256, generator=generator).to(torch.bfloat16)
    e4m3 = torch.rand(4, 128, generator=generator).mul(300).to(torch.float8_e4m3fn)
    every_e8m0 = torch.arange(0, 255, dtype=torch.uint8)
    every_e8m0 = torch.cat((every_e8m0, every_e8m0[:1])).reshape(4, 64).view(torch.float8_e8m0fnu)
    return {
        "path": "helpers",
        "shapes": shapes,
        "permute_scales": {
            "grouped": (scales, 1024, 256, 128),
            "one-group": (scales[:1], 128, 256, 128),
            "channel": (scales[:1], 4096, 256, -1),
        },
        "zero_points": {
            "4bit": (torch.randint(0, 16, (4, 128), generator=generator, dtype=torch.int32), 4, 128, 4),
            "8bit": (torch.randint(0, 256, (2, 64), generator=generator, dtype=torch.int32), 2, 64, 8),
        },
        "nvfp4_scales": {
            "bf16": (e4m3.to(torch.bfloat16), torch.bfloat16),
            "fp16": (e4m3.to(torch.float16), torch.float16),
            "tiny-bf16": ((e4m3.float() / 512).to(torch.float8_e4m3fn).to(torch.bfloat16), torch.bfloat16),
        },
        "nvfp4_global": {
            "bf16": (torch.tensor([3.0e-3]), torch.bfloat16),
            "fp16": (torch.tensor([0.7]), torch.float16),
        },
        "mxfp4_scales": {"bf16-every": every_e8m0.to(torch.bfloat16), "fp16-every": every_e8m0.to(torch.float16)},
        "fp8_scales": {"bf16": scales, "fp16": scales.to(torch.float16) * 300},
        "bias": {"bf16": torch.randn(256, generator=generator).to(torch.bfloat16)},
        "tiles": {
            "4bit": (
                torch.randint(-(2**31), 2**31 - 1, (32, 192), generator=generator, dtype=torch.int32),
                256,
                192,
                4,
            ),
            "8bit": (torch.randint(-(2**31), 2**31 - 1, (32, 64), generator=generator, dtype=torch.int32), 128, 64, 8),
        },
    }


@pytest.fixture(scope="module")
def vllm_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """vLLM's outputs for every case and for the helpers, from one oracle run."""
    assert VLLM_PYTHON is not None
    folder = tmp_path_factory.mktemp("vllm-oracle")
    torch.save([case.oracle for case in CASES] + [_helper_inputs()], folder / "in.pt")
    subprocess.run([VLLM_PYTHON, str(ORACLE), str(folder / "in.pt"), str(folder / "out.pt")], check=True)
    out = torch.load(folder / "out.pt")
    results = out["results"]
    return {
        "version": out["vllm_version"],
        "cases": dict(zip((c.name for c in CASES), results[:-1], strict=True)),
        "helpers": results[-1],
    }


def bits_equal(ours: Tensor, theirs: Tensor) -> bool:
    """Same dtype, shape and bytes."""
    if ours.dtype != theirs.dtype or ours.shape != theirs.shape:
        return False
    return torch.equal(ours.contiguous().view(torch.uint8), theirs.contiguous().view(torch.uint8))


def test_ci_runs_the_vllm_oracle() -> None:
    """In CI the oracle must be installed (scripts/test.sh builds .venv-vllm): fail, never skip."""
    if not os.environ.get("CI"):
        pytest.skip("outside CI the vLLM oracle is optional (set QSCHEME_VLLM_PYTHON to run it)")
    assert VLLM_PYTHON, "CI is set but QSCHEME_VLLM_PYTHON is not: run scripts/install-vllm-oracle.sh and export it"


@needs_vllm
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
@pytest.mark.oracle
def test_prepare_matches_vllm(case: Case, vllm_results: dict[str, Any]) -> None:
    theirs = vllm_results["cases"][case.name]
    ours = ml.marlin_operands(case.weight, case.dtype)
    assert bits_equal(ours.packed_weight, theirs["repack_input"]), "repack input"
    tiles = ml.marlin_tiles(ours.packed_weight, ours.padded_k, ours.padded_n, ours.bits)
    weight_name = "weight_packed" if case.oracle["path"] == "int" else "weight"
    assert bits_equal(tiles, theirs[weight_name]), "repacked weight"
    assert bits_equal(ours.scales, theirs["weight_scale"]), "scales"
    if ours.global_scale is not None:
        assert bits_equal(ours.global_scale, theirs["weight_global_scale"].reshape(1)), "global scale"
    else:
        assert "weight_global_scale" not in theirs
    if ours.zero_points is not None:
        assert bits_equal(ours.zero_points, theirs["weight_zero_point"]), "zero points"
    else:
        assert case.oracle["path"] != "int" or case.weight.zero_point is None
    if case.bias is not None:
        bias = ml.marlin_permute_bias(torch.nn.functional.pad(case.bias, (0, ours.padded_n - ours.n)))
        assert bits_equal(bias, theirs["bias"]), "bias"


@needs_vllm
@pytest.mark.oracle
def test_helpers_match_vllm(vllm_results: dict[str, Any]) -> None:
    inputs, theirs = _helper_inputs(), vllm_results["helpers"]
    assert [ml.marlin_padded_nk(n, k, g) for n, k, g in inputs["shapes"]] == [tuple(nk) for nk in theirs["padded_nk"]]
    assert torch.equal(ml.marlin_weight_perm(4), theirs["weight_perm_4"])
    assert torch.equal(ml.marlin_weight_perm(8), theirs["weight_perm_8"])
    assert all(torch.equal(a, b) for a, b in zip(ml._scale_perms(), theirs["scale_perms"], strict=True))
    for name, (scales, size_k, size_n, group) in inputs["permute_scales"].items():
        assert bits_equal(ml.marlin_permute_scales(scales, size_k, size_n, group), theirs[f"permute_scales/{name}"]), (
            name
        )
    for name, (zero_points, groups, size_n, bits) in inputs["zero_points"].items():
        assert bits_equal(ml.marlin_zero_points(zero_points, groups, size_n, bits), theirs[f"zero_points/{name}"]), name
    for name, (scales, dtype) in inputs["nvfp4_scales"].items():
        processed, factor = ml.nvfp4_marlin_scales(scales, dtype)
        assert factor == theirs[f"nvfp4_factor/{name}"], name
        assert bits_equal(processed, theirs[f"nvfp4_scales/{name}"]), name
    assert theirs["nvfp4_factor/tiny-bf16"] > 1.0  # the rescaling path is exercised
    for name, (global_scale, dtype) in inputs["nvfp4_global"].items():
        assert bits_equal(ml.nvfp4_marlin_global_scale(global_scale, dtype), theirs[f"nvfp4_global/{name}"]), name
    for name, scales in inputs["mxfp4_scales"].items():
        assert bits_equal(ml.mxfp4_marlin_scales(scales), theirs[f"mxfp4_scales/{name}"]), name
    for name, scales in inputs["fp8_scales"].items():
        assert bits_equal(ml.fp8_marlin_scales(scales), theirs[f"fp8_scales/{name}"]), name
    for name, bias in inputs["bias"].items():
        assert bits_equal(ml.marlin_permute_bias(bias), theirs[f"bias/{name}"]), name
    for name, (packed, size_k, size_n, bits) in inputs["tiles"].items():
        assert bits_equal(ml.marlin_tiles(packed, size_k, size_n, bits), theirs[f"tiles/{name}"]), name


@needs_vllm
@pytest.mark.oracle
def test_oracle_is_the_supported_vllm(vllm_results: dict[str, Any]) -> None:
    assert vllm_results["version"].startswith("0.33."), vllm_results["version"]


# --- without vLLM: properties of the layouts ----------------------------------------------------


def test_cases_cover_padding_and_every_family() -> None:
    padded = [c for c in CASES if ml.marlin_padded_nk(c.weight.n, c.weight.k, 16) != (c.weight.n, c.weight.k)]
    assert padded, "some case must pad N"
    families = {(c.weight.scheme.weight.format, c.weight.zero_point is not None) for c in CASES}
    assert families == set(ml.SCALAR_TYPES) - {("uint4", True)}


@pytest.mark.parametrize("bits", (4, 8))
def test_weight_perm_is_a_permutation(bits: int) -> None:
    perm = ml.marlin_weight_perm(bits)
    assert torch.equal(perm.sort().values, torch.arange(ml.PERM_BLOCK))


@pytest.mark.parametrize("bits", (4, 8))
def test_tiles_keep_every_value(bits: int) -> None:
    """The repack only moves values: the multiset of values per 16-row slab is unchanged."""
    generator = torch.Generator().manual_seed(bits)
    packed = torch.randint(-(2**31), 2**31 - 1, (64 * bits // 32, 128), generator=generator, dtype=torch.int32)
    tiles = ml.marlin_tiles(packed, 64, 128, bits)
    assert tiles.shape == (64 // 16, 128 * 16 * bits // 32)
    before = ml._unpack_rows(packed.T.contiguous(), bits).T.reshape(4, -1).sort(-1).values
    after = ml._unpack_rows(tiles, bits).sort(-1).values
    assert torch.equal(before, after)


def test_pack_input_is_the_canonical_bytes_for_fp4_and_fp8() -> None:
    weight = random_weight(builtin_scheme("compressed-tensors/NVFP4A16"), 64, 128, seed=1)
    packed = ml.marlin_pack_input(weight.codes, "e2m1", 128)
    assert torch.equal(packed, weight.codes.view(torch.int32).T)
    fp8 = random_weight(builtin_scheme("compressed-tensors/FP8"), 64, 128, seed=1)
    assert torch.equal(ml.marlin_pack_input(fp8.codes, "e4m3", 128), fp8.codes.view(torch.int32).T)


def test_int4_codes_are_biased_by_eight() -> None:
    codes = torch.tensor([[0x98, 0x07, 0x00, 0xFF]], dtype=torch.uint8)  # -8, -7, 7, 0, 0, 0, -1, -1
    packed = ml.marlin_pack_input(codes, "int4", 8)
    assert ml._unpack_rows(packed.T.contiguous(), 4).tolist() == [[0, 1, 15, 8, 8, 8, 7, 7]]
    int8 = torch.tensor([[-128, -1, 0, 127]], dtype=torch.int8)
    assert ml._unpack_rows(ml.marlin_pack_input(int8, "int8", 4).T.contiguous(), 8).tolist() == [[0, 127, 128, 255]]


def test_nvfp4_scales_decode_to_the_lifted_scale() -> None:
    """The S0E5M3 byte (five exponent bits, bias 15, three mantissa bits, no sign) holds the
    scale times 2**7 times the factor, for every scale that stays at or above 2 after lifting."""
    e4m3 = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scales = e4m3[:120].to(torch.bfloat16).reshape(2, 60)
    processed, factor = ml.nvfp4_marlin_scales(scales, torch.bfloat16)
    byte = processed.view(torch.uint8).to(torch.int32)
    exponent, mantissa = byte >> 3, byte & 7
    decoded = torch.where(exponent > 0, (1 + mantissa / 8) * torch.exp2(exponent.float() - 15), mantissa / 8 * 2.0**-14)
    half = scales.reshape(-1, 4)[:, [0, 2, 1, 3]].reshape(2, 60).float()
    lifted = half * factor * 2**7
    kept = lifted >= 2
    assert factor == 2.0 ** math.floor(math.log2(448 / float(scales.float().max())))
    assert torch.equal(decoded[kept].float(), lifted[kept])
    assert bool((decoded[~kept] == 0).all())


def test_global_scale_exponent_bias() -> None:
    one = torch.ones(1)
    assert ml.nvfp4_marlin_global_scale(one, torch.bfloat16).item() == 2.0**119
    assert ml.nvfp4_marlin_global_scale(one, torch.float16, scale_factor=4.0).item() == 2.0**5
    assert ml.fp8_marlin_scales(torch.ones(1, dtype=torch.float16)).item() == 2.0**8


def test_unequal_global_scales_are_refused() -> None:
    weight = random_weight(builtin_scheme("compressed-tensors/NVFP4A16"), 128, 128, partitions=(64, 64), seed=0)
    assert not torch.equal(weight.global_scale[0], weight.global_scale[1])  # type: ignore[index]
    with pytest.raises(UsageError, match="one global scale per layer"):
        ml.marlin_operands(weight, torch.bfloat16)
    equal = replace(weight, global_scale=weight.global_scale[:1].repeat(2))  # type: ignore[index]
    assert ml.marlin_operands(equal, torch.bfloat16).global_scale is not None


def test_unsupported_formats_and_dtypes_are_refused() -> None:
    with pytest.raises(UsageError, match="no scalar type for uint4 weights"):
        ml.marlin_scalar_type("uint4", zero_points=False)
    with pytest.raises(UsageError, match="bfloat16 and float16"):
        ml.marlin_operands(random_weight(int_scheme("int4", 128, False), 64, 128), torch.float32)
    assert ml.marlin_scalar_type("int4", zero_points=True) == "uint4"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__]))
