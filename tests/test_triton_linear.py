"""Host-side choices of the Triton kernels (qscheme.triton.linear): the dtype 4-bit weights are
decoded in, the layout of tiled scales, the decode tiles, and the split-K mode."""

from __future__ import annotations

import pytest
import torch

from qscheme.catalog import load_catalog
from qscheme.descriptor import Scheme, parse_scheme_text
from qscheme.errors import QuantizeError
from qscheme.triton import linear as lin
from qscheme.triton.samples import random_weight
from qscheme.triton.spec import DECODE_BF16, DECODE_FP16, DECODE_FP32, specialize

BUILTIN = {s.name: s for s in load_catalog(include_plugins=False) if s.weight.blocks is None}  # blocks: not Triton's
SPECS = {name: specialize(scheme) for name, scheme in BUILTIN.items()}
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def test_decode_dtype_is_16_bit_only_where_every_scaled_weight_is_exact_before_one_rounding() -> None:
    w4a16, nvfp4, mx = (
        SPECS["compressed-tensors/W4A16"],
        SPECS["compressed-tensors/NVFP4A16"],
        SPECS["compressed-tensors/MXFP4A16"],
    )
    assert lin.decode_dtype(w4a16, BF16, BF16, True) == DECODE_BF16
    assert lin.decode_dtype(w4a16, FP16, FP16, True) == DECODE_FP16
    assert lin.decode_dtype(w4a16, BF16, FP16, True) == DECODE_FP32  # an fp16 scale is not exact in bf16
    assert lin.decode_dtype(w4a16, BF16, FP32, True) == DECODE_FP32
    assert lin.decode_dtype(w4a16, FP32, FP32, True) == DECODE_FP32  # a float32 dot
    assert lin.decode_dtype(w4a16, BF16, BF16, False) == DECODE_FP32  # the interpreter
    assert lin.decode_dtype(nvfp4, BF16, None, True) == DECODE_BF16  # e4m3 scales
    assert lin.decode_dtype(nvfp4, FP16, None, True) == DECODE_FP16  # e2m1 x e4m3 is exact in fp16 too
    assert lin.decode_dtype(mx, BF16, None, True) == DECODE_BF16  # e8m0 is exact in bf16 ...
    assert lin.decode_dtype(mx, FP16, None, True) == DECODE_FP32  # ... not in fp16
    assert lin.decode_dtype(SPECS["compressed-tensors/FP8"], BF16, None, True) == DECODE_FP32  # 8-bit codes


def test_wide_decode_tiles_for_4_bit_weights_decoded_in_16_bit() -> None:
    assert lin.wide_decode(SPECS["compressed-tensors/NVFP4A16"], BF16)
    assert lin.wide_decode(SPECS["compressed-tensors/W4A16"], BF16, BF16)
    assert not lin.wide_decode(SPECS["compressed-tensors/W4A16"], BF16, FP32)  # float32 decode
    assert lin.wide_decode(SPECS["compressed-tensors/NVFP4"], BF16)  # inputs arrive decoded
    assert not lin.wide_decode(SPECS["compressed-tensors/MXFP4"], FP16)  # e8m0: neither side in fp16
    assert not lin.wide_decode(SPECS["compressed-tensors/FP8_DYNAMIC"], BF16)  # 8-bit weights


@pytest.mark.parametrize(
    ("name", "scale_dtype", "stored", "widened"),
    [
        ("compressed-tensors/W4A16", "bfloat16", torch.float32, True),  # one 2-byte scale per row and tile
        ("compressed-tensors/W4A16", "float32", torch.float32, False),
        ("compressed-tensors/NVFP4A16", None, torch.uint8, False),  # 8 e4m3 bytes per row and tile
        ("compressed-tensors/MXFP4A16", None, torch.uint8, False),  # e8m0 bits stay bytes
    ],
)
def test_tiled_scales_are_widened_only_where_a_tile_would_hold_under_4_bytes_of_a_row(
    name: str, scale_dtype: str | None, stored: torch.dtype, widened: bool
) -> None:
    weight = random_weight(BUILTIN[name], 64, 512, scale_dtype=scale_dtype)
    prepared = lin.prepare_weight(weight, "cpu")
    assert prepared.scale is not None and prepared.scale.dtype == stored and prepared.scale.is_contiguous()
    assert prepared.scale_dtype == weight.scale.dtype
    original = weight.scale.view(torch.uint8) if weight.scale.dtype == torch.float8_e4m3fn else weight.scale
    assert torch.equal(prepared.scale, original.to(stored))  # exact either way
    assert (prepared.scale.element_size() != original.element_size()) == widened


def test_asymmetric_zero_points_are_widened_with_their_scales() -> None:
    weight = random_weight(BUILTIN["compressed-tensors/W4A16_ASYM"], 64, 512, scale_dtype="bfloat16")
    prepared = lin.prepare_weight(weight, "cpu")
    assert prepared.zero_point is not None and prepared.zero_point.dtype == torch.int32
    assert torch.equal(prepared.zero_point, weight.zero_point.to(torch.int32).reshape(weight.scale.shape))


def _uint8_group_scheme(group: int) -> Scheme:
    return parse_scheme_text(
        f"""
name: test/UINT8_G{group}_ZP
weight:
  format: uint8
  tensor: {{name: weight, dtype: uint8, shape: [N, K]}}
  scale: {{granularity: group, group_size: {group}, format: fp32, stored: multiplier,
          tensor: {{name: weight_scale, dtype: float32, shape: [N, "ceil(K/{group})"]}}}}
  zero_point: {{format: uint8, tensor: {{name: weight_zero_point, dtype: uint8, shape: [N, "ceil(K/{group})"]}}}}
activation: none
"""
    )


@pytest.mark.parametrize(("group", "stored"), [(32, torch.uint8), (128, torch.int32)])
def test_unsigned_zero_points_keep_values_above_127(group: int, stored: torch.dtype) -> None:
    # uint8 zero points go to the GEMM as uint8 (widened to int32 where a tile holds under 4 bytes)
    weight = random_weight(_uint8_group_scheme(group), 16, 512)
    assert weight.zero_point is not None and int(weight.zero_point.max()) == 255
    prepared = lin.prepare_weight(weight, "cpu")
    assert prepared.zero_point is not None and prepared.zero_point.dtype == stored
    assert torch.equal(prepared.zero_point.to(torch.int32), weight.zero_point.to(torch.int32))


def test_split_k_mode_rejects_unknown_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(lin.SPLIT_K_VARIABLE, raising=False)
    assert lin.split_k_mode() == "two-pass"
    monkeypatch.setenv(lin.SPLIT_K_VARIABLE, "fast")
    with pytest.raises(QuantizeError, match=r"QSCHEME_TRITON_SPLIT_K='fast' is not one of two-pass, fused"):
        lin.split_k_mode()
    monkeypatch.setenv(lin.SPLIT_K_VARIABLE, " Fused ")
    assert lin.split_k_mode() == "fused"


def _fingerprint(name: str, value: object) -> object:
    """A launch argument as comparable data: a tensor by where and how it points (the split-K
    partial sums, a new buffer per call, by their shape alone)."""
    if isinstance(value, torch.Tensor):
        where = None if name in ("out_ptr", "partial_ptr") and value.dtype == torch.float32 else value.data_ptr()
        return ("tensor", where, tuple(value.shape), value.stride(), value.dtype)
    return value


def _launch_data(launches: list) -> list:  # type: ignore[type-arg]
    return [
        (
            launch.kernel,
            launch.grid,
            {name: _fingerprint(name, value) for name, value in launch.args.items()},
            dict(launch.constexprs),
            launch.num_warps,
            launch.num_stages,
            launch.label,
        )
        for launch in launches
    ]


def test_launches_from_a_kept_template_equal_launches_built_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """gemm_launches keeps what depends on the weight and tile alone (``PreparedWeight.memo``).
    Calls with other M, other tensors, with and without a bias, per segment, on the GPU and
    interpreter backends, in both split-K modes, must get exactly the launches a fresh build
    gives: the call's own tensors, the weight's slices, and that call's constexprs."""
    scheme = BUILTIN["modelopt/NVFP4"]
    prepared = lin.prepare_weight(random_weight(scheme, 96, 256, partitions=(32, 32, 32), seed=5), "cpu")
    assert len(prepared.segments) == 3
    tile = lin.configs.TileConfig(16, 32, 64, split_k=2, num_warps=4, num_stages=2)
    calls = 0
    for backend, dtype in (("cuda", BF16), ("interpreter", FP32), ("cuda", FP16)):
        # (M, bias, split-K mode, native fp8, decoded inputs): the fifth and sixth differ from the
        # first in one flag each; the last reuses the first's templates
        cases = (
            (1, False, "two-pass", False, False),
            (5, True, "fused", True, True),
            (3, False, "fused", False, True),
            (5, True, "two-pass", True, False),
            (2, False, "two-pass", True, False),
            (4, False, "two-pass", False, True),
            (6, False, "two-pass", False, False),
        )
        for m, with_bias, split_k, native_fp8, decoded in cases:
            monkeypatch.setenv(lin.SPLIT_K_VARIABLE, split_k)
            x = torch.randn(m, 256).to(dtype)
            bias = torch.randn(96).to(dtype) if with_bias else None
            out = torch.empty(m, 96, dtype=dtype)
            for segment in prepared.segments:
                call = (segment, x, None, bias, out, tile, dtype, backend, native_fp8, decoded)
                kept = lin.gemm_launches(prepared, *call)
                memo = dict(prepared.memo)
                prepared.memo.clear()
                fresh = lin.gemm_launches(prepared, *call)
                prepared.memo.update(memo)
                assert _launch_data(kept) == _launch_data(fresh)
                assert len(kept) == (1 if split_k == "fused" else 2)
                args = kept[0].args
                assert args["x_ptr"] is x and args["M"] == m
                assert kept[0].constexprs["HAS_BIAS"] is with_bias
                assert kept[0].constexprs["FUSED_SPLIT_K"] is (split_k == "fused")
                assert kept[0].constexprs["NATIVE_FP8"] is native_fp8
                assert kept[0].constexprs["A_QUANTIZED"] is not decoded
                final = args["final_ptr"]
                assert final.data_ptr() == out[:, segment.start :].data_ptr()
                assert final.shape == (m, segment.end - segment.start)
                calls += 1
    # one template per (segment, backend and dtype, flags): six distinct, seven calls
    assert calls == 3 * 3 * 7 and len(prepared.memo) == 3 * 3 * 6


def test_one_prepared_weight_serves_calls_with_and_without_bias() -> None:
    """The kept templates must not carry one call's bias (or its absence) into the next."""
    from triton_samples import assert_matches, reference_output

    scheme = BUILTIN["compressed-tensors/NVFP4A16"]
    weight = random_weight(scheme, 48, 160, seed=7)
    prepared = lin.prepare_weight(weight, "cpu")
    bias = torch.randn(48, generator=torch.Generator().manual_seed(8))
    for m, b in ((1, None), (4, bias), (1, bias), (4, None)):
        x = torch.randn(m, 160, generator=torch.Generator().manual_seed(m))
        assert_matches(lin.linear(prepared, x, b), reference_output(weight, x, b), FP32, f"M={m} bias={b is not None}")


_OVERFLOW_SCRIPT = """
import torch
from qscheme.catalog import load_scheme
from qscheme.triton.linear import linear, prepare_weight
from qscheme.triton.samples import random_weight

weight = random_weight(load_scheme("compressed-tensors/W4A16"), 16, 128, seed=1)
prepared = prepare_weight(weight, "cpu")
stride = 2**30 + 1  # row 2 starts 2**31 + 2 elements in: past a 32-bit offset
storage = torch.empty(3 * stride, dtype=torch.float16)  # virtual: only 3 rows are touched
x = storage.as_strided((3, 128), (stride, 1))
x.copy_(torch.randn(3, 128, generator=torch.Generator().manual_seed(2)).half())
far, near = linear(prepared, x), linear(prepared, x.contiguous())
assert float(near.abs().max()) > 0
print("equal", torch.equal(far, near))
"""


@pytest.mark.subprocess
def test_inputs_past_32_bit_offsets_are_launched_in_row_ranges() -> None:
    """x rows 2**31 elements apart (a strided view standing in for a long prefill's M x K past
    2**31): the kernels' 32-bit row offsets would wrap (a crash under the interpreter, a wrong
    read on a GPU); linear launches row ranges with their pointers advanced instead."""
    import os
    import subprocess
    import sys

    environment = dict(os.environ, TRITON_INTERPRET="1")
    completed = subprocess.run(
        [sys.executable, "-c", _OVERFLOW_SCRIPT], env=environment, capture_output=True, text=True, timeout=600
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "equal True" in completed.stdout


def test_long_inputs_run_in_row_chunks_with_the_same_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    from triton_samples import assert_matches, reference_output

    weight = random_weight(BUILTIN["compressed-tensors/NVFP4"], 48, 160, seed=4)
    prepared = lin.prepare_weight(weight, "cpu")
    x = torch.randn(21, 160, generator=torch.Generator().manual_seed(5))
    bias = torch.randn(48, generator=torch.Generator().manual_seed(6))
    whole = lin.linear(prepared, x, bias)
    monkeypatch.setattr(lin, "MAX_OFFSET", 8 * 160)  # 8 rows of x per launch
    chunks: list[int] = []
    run_segment = lin._run_segment
    monkeypatch.setattr(
        lin, "_run_segment", lambda p, s, x, *rest: chunks.append(x.shape[0]) or run_segment(p, s, x, *rest)
    )
    chunked = lin.linear(prepared, x, bias)
    assert chunks == [8, 8, 5]
    assert_matches(chunked, reference_output(weight, x, bias), FP32, "chunked")
    assert torch.equal(chunked[:16], whole[:16])  # same tiles for full chunks: the same bits


def test_weights_past_32_bit_offsets_run_as_row_ranges_on_scale_block_boundaries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from triton_samples import assert_matches, reference_output

    monkeypatch.setattr(lin, "MAX_OFFSET", 200 * 256)  # 200 rows of 256 one-byte codes
    weight = random_weight(BUILTIN["compressed-tensors/FP8_BLOCK"], 384, 256, seed=7)
    prepared = lin.prepare_weight(weight, "cpu")
    assert [(s.start, s.end) for s in prepared.segments] == [(0, 128), (128, 256), (256, 384)]
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(8))
    assert_matches(lin.linear(prepared, x), reference_output(weight, x), FP32, "row ranges")


def test_split_k_is_lowered_only_where_partial_sums_would_pass_32_bit_offsets() -> None:
    tile = lin.configs.TileConfig(16, 64, 128, split_k=8)
    assert lin._fit_split_k(tile, 16, 8192) is tile
    assert lin._fit_split_k(tile, 2**16, 8192).split_k == 2  # 2 x 2**29 partial sums fit
    assert lin._fit_split_k(tile, 2**18, 8192).split_k == 1


def test_a_strided_or_expanded_bias_is_added_as_its_values() -> None:
    """The epilogue reads the bias as contiguous: a view with another stride (every other
    element, one value expanded, even from a one-element storage) must be added as nn.Linear
    adds it, not read past it."""
    prepared = lin.prepare_weight(random_weight(BUILTIN["compressed-tensors/NVFP4A16"], 48, 160, seed=1), "cpu")
    x = torch.randn(3, 160, generator=torch.Generator().manual_seed(2))
    base = torch.arange(96, dtype=torch.float32)
    for bias in (base[::2], base[5:6].expand(48), torch.tensor([1.5]).expand(48), torch.randn(48, 3)[:, 1]):
        assert torch.equal(lin.linear(prepared, x, bias), lin.linear(prepared, x, bias.contiguous()))


def test_weight_rows_too_wide_for_one_scale_block_within_32_bit_offsets_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(lin, "MAX_OFFSET", 100 * 256)  # under one 128-row scale block of 256 codes
    with pytest.raises(QuantizeError, match=r"too wide for the Triton kernel's 32-bit offsets in blocks of 128 rows"):
        lin.prepare_weight(random_weight(BUILTIN["compressed-tensors/FP8_BLOCK"], 384, 256, seed=7), "cpu")


def test_a_weight_under_32_bit_offsets_is_never_cut_or_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fewer rows than one scale block, the whole weight within the limit: nothing to cut."""
    monkeypatch.setattr(lin, "MAX_OFFSET", 100 * 256)
    prepared = lin.prepare_weight(random_weight(BUILTIN["compressed-tensors/FP8_BLOCK"], 64, 256, seed=7), "cpu")
    assert [(s.start, s.end) for s in prepared.segments] == [(0, 64)]


def test_a_replaced_prepared_weight_keeps_no_templates_of_the_original() -> None:
    """dataclasses.replace makes a new weight; launches kept for the old one point at its tensors."""
    from dataclasses import replace

    scheme = BUILTIN["compressed-tensors/NVFP4A16"]
    first = lin.prepare_weight(random_weight(scheme, 48, 160, seed=1), "cpu")
    second = lin.prepare_weight(random_weight(scheme, 48, 160, seed=2), "cpu")
    x = torch.randn(2, 160, generator=torch.Generator().manual_seed(3))
    lin.linear(first, x)
    swapped = replace(first, codes=second.codes, scale=second.scale, row_scale=second.row_scale)
    assert swapped.memo is not first.memo and not swapped.memo
    assert torch.equal(lin.linear(swapped, x), lin.linear(second, x))
