"""The native FP8 / int8 activation pass (``qscheme.emulation_native``: the quantize-dequantize,
the codes' values with their scales, and the tile GEMMs' prepared input with the AWQ pre-scale and a
bfloat16 output) against the torch path of ``qscheme.emulation``, bit for bit: every rule it takes,
float32 and bfloat16 inputs, ragged groups, 3-D inputs, zero rows (the float32-eps scale), e4m3
subnormals, ties, saturation and signed zeros, bfloat16 ties, rows shared over threads, on the
AVX-512 loop (where this CPU runs it) and the portable one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import Tensor

from qscheme import cpu_gemv, emulation_native
from qscheme.catalog import load_scheme
from qscheme.descriptor import ActivationSpec
from qscheme.emulation import (
    activation_codes,
    activation_rule,
    apply_pre_scale,
    fake_quantize_activation,
    prepare_input,
    quantize_activation,
)
from qscheme.errors import QuantizeError
from qscheme.formats import all_codes, decode

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason="qscheme._cpu_gemv is not built here")

PRESETS = {
    "FP8 per tensor": "compressed-tensors/FP8",
    "FP8 per token": "compressed-tensors/FP8_DYNAMIC",
    "FP8 per group": "compressed-tensors/FP8_BLOCK",
    "int8 per token": "compressed-tensors/W8A8",
}


@pytest.fixture(autouse=True)
def isa_restored() -> Iterator[None]:
    before = cpu_gemv.isa()
    yield
    cpu_gemv.set_isa(before)


def spec(rule: str) -> ActivationSpec:
    activation = load_scheme(PRESETS[rule]).activation
    assert activation is not None and activation_rule(activation).name == rule
    return activation


def isas() -> list[str]:
    return ["scalar", "avx512"] if cpu_gemv.supported_isa() == "avx512" else ["scalar"]


def both_paths(x: Tensor, activation: ActivationSpec, monkeypatch: pytest.MonkeyPatch, **scales: Tensor) -> None:
    with monkeypatch.context() as patch:
        patch.setenv(emulation_native.VARIABLE, "0")
        expected = fake_quantize_activation(x, activation, **scales)
    rule = activation_rule(activation)
    for isa in isas():
        cpu_gemv.set_isa(isa)
        native = emulation_native.fake_quantize(x, rule, scales.get("input_scale"))
        assert native is not None, (rule.name, isa)
        assert native.dtype == torch.float32 and native.shape == x.shape
        # bit for bit, signed zeros included
        assert torch.equal(native.view(torch.int32), expected.view(torch.int32)), (rule.name, isa, x.dtype)
        assert torch.equal(
            fake_quantize_activation(x, activation, **scales).view(torch.int32), native.view(torch.int32)
        )
    if rule.name in emulation_native.CODE_MODES:
        both_code_paths(x, activation, monkeypatch, **scales)
    generator = torch.Generator().manual_seed(x.shape[-1])
    pre_scale = torch.rand(x.shape[-1], generator=generator) * 3.75 + 0.25
    for pre in (None, pre_scale):
        prepared_paths(x, activation, monkeypatch, pre, **scales)


def prepared_paths(
    x: Tensor,
    activation: ActivationSpec | None,
    monkeypatch: pytest.MonkeyPatch,
    pre_scale: Tensor | None,
    **scales: Tensor,
) -> None:
    """``prepare_input`` (the native pass) against the torch path's float32 values cast to each
    output dtype, bit for bit, on one and on three threads."""
    with monkeypatch.context() as patch:
        patch.setenv(emulation_native.VARIABLE, "0")
        values = x.to(torch.float32) if pre_scale is None else apply_pre_scale(x, pre_scale)
        expected = values if activation is None else fake_quantize_activation(values, activation, **scales)
    rule = None if activation is None else activation_rule(activation)
    for isa in isas():
        cpu_gemv.set_isa(isa)
        for dtype in (torch.float32, torch.bfloat16):
            for threads in (1, 3):
                found = emulation_native.input_pass(rule, scales.get("input_scale"), pre_scale)
                assert found is not None
                native = emulation_native.apply_pass(x, found, dtype, threads)
                assert native is not None and native.dtype == dtype and native.shape == x.shape
                wanted = expected.to(dtype)
                bits = torch.int32 if dtype == torch.float32 else torch.int16
                assert torch.equal(native.view(bits), wanted.view(bits)), (isa, dtype, threads, x.dtype)
                public = prepare_input(x, activation, pre_scale=pre_scale, dtype=dtype, threads=threads, **scales)
                assert torch.equal(public.view(bits), wanted.view(bits))


def inputs(k: int, dtype: torch.dtype, seed: int) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, k, generator=generator) * torch.logspace(-12, 6, 5).reshape(1, 5, 1)
    x[0, 0] = 0  # a zero token: the scale is float32 eps
    x[0, 1, ::3] = -0.0
    x[1, 2, : k // 2] = 1e-30  # tiny values against a large one: e4m3 subnormals and zeros
    return x.to(dtype)


@pytest.mark.parametrize("rule", ["FP8 per token", "FP8 per group", "int8 per token"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [16, 200, 4096, 300])  # 300 and 200: a ragged last group of 128, a tail of 16
def test_dynamic_rules_match_the_torch_path(
    rule: str, dtype: torch.dtype, k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    both_paths(inputs(k, dtype, seed=k), spec(rule), monkeypatch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 3.7e-3, 1e-30])  # 1e-30: every element saturates at 448
def test_the_static_rule_matches_the_torch_path(
    dtype: torch.dtype, scale: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    both_paths(inputs(333, dtype, seed=7), spec("FP8 per tensor"), monkeypatch, input_scale=torch.tensor([scale]))


def test_every_e4m3_midpoint_rounds_to_even(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each value, each midpoint between neighbours (ties), and each just inside, with a unit scale."""
    values = decode(all_codes("e4m3"), "e4m3")
    values = values[values.isfinite() & (values >= 0)].sort().values
    middle = (values[1:] + values[:-1]) / 2
    beyond = torch.tensor([448.0, 460.0, 464.0, 470.0, 1e30])
    row = torch.cat([values, middle, torch.nextafter(middle, values[1:]), torch.nextafter(middle, values[:-1]), beyond])
    both_paths(
        torch.cat([row, -row]).reshape(1, -1), spec("FP8 per tensor"), monkeypatch, input_scale=torch.tensor([1.0])
    )


def test_the_pre_scale_alone_and_bfloat16_ties(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a rule: x times the pre-scale, rounded to bfloat16 to nearest even (the products
    include exact ties between two bfloat16 values, and values past bfloat16's largest)."""
    ties = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8), 2.0**-130, 3.0e38, -1e-45, 0.0, -0.0])
    x = torch.cat([ties, torch.randn(300, generator=torch.Generator().manual_seed(3))]).reshape(2, -1)
    pre_scale = torch.ones(x.shape[-1])
    pre_scale[1::2] = 1.5
    for given in (x, x.to(torch.bfloat16)):
        prepared_paths(given, None, monkeypatch, pre_scale)


def test_rows_shared_over_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Enough rows for several tasks (64K elements each), a ragged last one."""
    x = torch.randn(37, 4096, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    both_paths(x, spec("FP8 per token"), monkeypatch)
    both_paths(x, spec("FP8 per tensor"), monkeypatch, input_scale=torch.tensor([0.02]))


def test_prepare_input_without_anything_to_apply_is_the_input() -> None:
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert prepare_input(x, None, dtype=torch.bfloat16) is x
    assert torch.equal(prepare_input(x, None), x.to(torch.float32))
    with pytest.raises(QuantizeError, match="input_pre_scale has shape"):
        prepare_input(x, None, pre_scale=torch.ones(63))


def test_int8_ties_and_negative_zeros(monkeypatch: pytest.MonkeyPatch) -> None:
    """amax 127.5 makes the scale exactly 1: halves round to even, small negatives to +0.0."""
    row = torch.tensor([127.5, -127.5, 0.5, 1.5, 2.5, -0.5, -1.5, -0.2, -0.0, 126.5, -126.5, 3.49999])
    both_paths(row.reshape(1, -1), spec("int8 per token"), monkeypatch)


def test_what_the_native_pass_does_not_take_falls_back() -> None:
    fp8 = activation_rule(spec("FP8 per token"))
    nvfp4 = load_scheme("compressed-tensors/NVFP4").activation
    assert nvfp4 is not None
    x = torch.randn(2, 64)
    assert emulation_native.fake_quantize(x, activation_rule(nvfp4), None) is None
    assert emulation_native.fake_quantize(x.half(), fp8, None) is None
    assert emulation_native.fake_quantize(x.requires_grad_(), fp8, None) is None
    assert emulation_native.fake_quantize(torch.randn(0, 64), fp8, None) is not None


def both_code_paths(x: Tensor, activation: ActivationSpec, monkeypatch: pytest.MonkeyPatch, **scales: Tensor) -> None:
    """``activation_codes`` against ``quantize_activation``'s decoded codes and block scales, bit for bit."""
    with monkeypatch.context() as patch:
        patch.setenv(emulation_native.VARIABLE, "0")
        assert activation_codes(x, activation, **scales) is None  # the native pass turned off
        quantized = quantize_activation(x, activation, **scales)
    expected_codes = decode(quantized.codes, quantized.format)
    expected_scales = quantized.block_scale().expand(*x.shape[:-1], 1)
    for isa in isas():
        cpu_gemv.set_isa(isa)
        found = activation_codes(x, activation, **scales)
        assert found is not None, isa
        codes, token_scales = found
        assert codes.dtype == torch.float32 and codes.shape == x.shape
        assert token_scales.dtype == torch.float32 and token_scales.shape == (*x.shape[:-1], 1)
        assert torch.equal(codes.view(torch.int32), expected_codes.view(torch.int32)), (isa, x.dtype)
        assert torch.equal(token_scales.view(torch.int32), expected_scales.view(torch.int32)), (isa, x.dtype)
        # and their product is the fake quantization's output
        assert torch.equal(codes * token_scales, fake_quantize_activation(x, activation, **scales))


def test_codes_refuse_other_rules_and_inputs() -> None:
    """Groups, NVFP4, float16 and inputs that need a gradient are not the pass's: None; bad
    scales are the torch path's errors; an empty input gives empty codes and scales."""
    x = torch.randn(2, 64)
    assert activation_codes(x, spec("FP8 per group")) is None
    nvfp4 = load_scheme("compressed-tensors/NVFP4").activation
    assert nvfp4 is not None
    assert activation_codes(x, nvfp4) is None
    assert activation_codes(x.half(), spec("FP8 per token")) is None
    assert activation_codes(x.clone().requires_grad_(), spec("FP8 per token")) is None
    with pytest.raises(QuantizeError, match="input_scale"):
        activation_codes(x, spec("FP8 per tensor"), input_scale=torch.tensor([-1.0]))
    with pytest.raises(QuantizeError, match="input_scale"):
        activation_codes(x, spec("FP8 per tensor"))
    empty = activation_codes(torch.randn(0, 64), spec("int8 per token"))
    assert empty is not None and empty[0].shape == (0, 64) and empty[1].shape == (0, 1)
