"""The Triton activation pre-pass (interpreted) against qscheme.emulation: codes and scales
bit for bit, for every activation quantization of the built-in and YAML-only schemes, on
random inputs and on the inputs that decide rounding (ties, saturation, zero groups)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qscheme.catalog import load_catalog
from qscheme.descriptor import Scheme, parse_scheme_file
from qscheme.emulation import quantize_activation
from qscheme.triton.act_quant import quantize_input
from qscheme.triton.spec import specialize

YAML_SCHEMES = sorted(Path(__file__).parent.joinpath("data", "triton_schemes").glob("*.yaml"))
ALL = [s for s in load_catalog(include_plugins=False) if s.weight.blocks is None] + [
    parse_scheme_file(path) for path in YAML_SCHEMES
]


def _one_per_rule(schemes: list[Scheme]) -> list[Scheme]:
    """One scheme per distinct activation quantization (several schemes share one)."""
    seen, chosen = set(), []
    for scheme in schemes:
        activation = scheme.activation
        if activation is None:
            continue
        key = (activation, "divisor" if scheme.rules == "compressed-tensors" else "multiplier")
        if key not in seen:
            seen.add(key)
            chosen.append(scheme)
    return chosen


QUANTIZED = _one_per_rule(ALL)


def _static_scales(scheme: Scheme) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, bool]:
    """(emulation keyword arguments, the pre-pass static scale, whether it is a divisor)."""
    activation = scheme.activation
    assert activation is not None
    if activation.scale is not None:
        value = torch.tensor([0.0173])
        return {"input_scale": value}, value, False
    if activation.global_scale is not None:
        if scheme.rules == "compressed-tensors":  # compressed-tensors' stored divisor
            divisor = torch.tensor([2688.0 / 41.3])
            return {"input_global_scale_divisor": divisor}, divisor, True
        multiplier = torch.tensor([41.3 / 2688.0])
        return {"input_global_scale": multiplier}, multiplier, False
    return {}, None, False


def _assert_identical(scheme: Scheme, x: torch.Tensor) -> None:
    activation = scheme.activation
    assert activation is not None
    keywords, static, divisor = _static_scales(scheme)
    expected = quantize_activation(x, activation, **keywords)
    actual = quantize_input(x, specialize(scheme), static_scale=static, divisor=divisor)
    codes = expected.codes.view(torch.uint8) if expected.codes.dtype == torch.float8_e4m3fn else expected.codes
    mismatched = (actual.codes != codes).nonzero()
    assert not len(mismatched), (
        f"{scheme.name}: {len(mismatched)} codes differ, first at {mismatched[0].tolist()}: "
        f"triton {int(actual.codes[tuple(mismatched[0])])}, emulation {int(codes[tuple(mismatched[0])])}"
    )
    if activation.dynamic:
        assert actual.scale is not None
        scale = expected.scale.view(torch.uint8) if expected.scale.dtype == torch.float8_e4m3fn else expected.scale
        assert torch.equal(actual.scale, scale.reshape(actual.scale.shape)), f"{scheme.name}: scales differ"
    else:
        assert actual.scale is None  # static scales are folded into the GEMM's epilogue


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("scheme", QUANTIZED, ids=[s.name for s in QUANTIZED])
@pytest.mark.interpreter
def test_random_inputs_quantize_bit_for_bit(scheme: Scheme, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    k = 300  # a ragged last group for every group size
    magnitudes = torch.logspace(-4, 2, k)  # groups of very different size, some tiny
    x = (torch.randn(7, k, generator=generator) * magnitudes).to(dtype)
    x[1, :64] = 0  # all-zero groups (NVFP4: 0.125 or zero block scales; absmax: eps scales)
    x[2] = 0  # an all-zero token
    _assert_identical(scheme, x)


def _mx_ties() -> torch.Tensor:
    """Groups of 32 whose MX scale is 2**e exactly, holding every e2m1 midpoint and tie."""
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 4.5, 0.0, 6.0])
    row = []
    for exponent in range(-3, 4):
        group = torch.cat([midpoints, -midpoints, torch.full((12,), 0.125)]) * 2.0**exponent
        group[-1] = 6.0 * 2.0**exponent  # the group's absmax: scale 2**exponent
        row.append(group)
    return torch.stack([torch.cat(row)] * 2)


def _e4m3_ties(scale: float) -> torch.Tensor:
    """Values whose quotient by ``scale`` falls on e4m3 ties, subnormals and saturation."""
    e4m3 = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    midpoints = (e4m3[1:] + e4m3[:-1]) / 2
    extremes = torch.tensor([448.0, 464.0, 480.0, 1e4, 2.0**-10, 2.0**-11, 3 * 2.0**-11])
    values = torch.cat([midpoints, -midpoints, extremes, -extremes])
    return (values * scale).reshape(1, -1)


def _int8_ties() -> torch.Tensor:
    """Per token scale exactly 1 (absmax 127.5): every half-integer is a tie."""
    values = torch.arange(-127, 127, dtype=torch.float32) + 0.5
    return torch.cat([values, torch.tensor([127.5, -127.5])]).reshape(1, -1)


def _scheme(name: str) -> Scheme:
    return next(scheme for scheme in ALL if scheme.name == name)


def test_mx_ties_round_to_even() -> None:
    _assert_identical(_scheme("compressed-tensors/MXFP4"), _mx_ties())


def test_fp8_static_ties_subnormals_and_saturation() -> None:
    _assert_identical(_scheme("compressed-tensors/FP8"), _e4m3_ties(0.0173))


def test_fp8_dynamic_ties() -> None:
    x = _e4m3_ties(1.0).clamp(-448.0, 448.0)  # absmax 448: the per-token scale is exactly 1
    _assert_identical(_scheme("compressed-tensors/FP8_DYNAMIC"), x)


def test_int8_ties_round_to_even() -> None:
    _assert_identical(_scheme("compressed-tensors/W8A8"), _int8_ties())


@pytest.mark.parametrize("name", ["compressed-tensors/NVFP4", "modelopt/NVFP4"])
def test_nvfp4_ties_and_tiny_groups(name: str) -> None:
    generator = torch.Generator().manual_seed(5)
    x = _mx_ties().repeat(1, 2)
    x[:, :16] = torch.randn(2, 16, generator=generator) * 1e-9  # block scales that round to zero
    x[:, 16:32] = 1e30  # saturating block scales
    _assert_identical(_scheme(name), x)


def test_pre_scale_is_applied_before_quantizing() -> None:
    scheme = _scheme("modelopt/NVFP4_AWQ")
    x = torch.randn(3, 64)
    pre_scale = torch.rand(64) + 0.5
    keywords, static, divisor = _static_scales(scheme)
    assert scheme.activation is not None
    expected = quantize_activation(x * pre_scale, scheme.activation, **keywords)
    actual = quantize_input(x, specialize(scheme), static_scale=static, divisor=divisor, pre_scale=pre_scale)
    assert torch.equal(actual.codes, expected.codes)
    assert torch.equal(actual.scale, expected.scale.view(torch.uint8))  # type: ignore[arg-type]


def _value_of(codes: torch.Tensor, element: str) -> torch.Tensor:
    """float32 values of the pre-pass's codes (e2m1 / e4m3 as uint8 bits, int8 as int8)."""
    from qscheme.formats import decode

    if element == "e4m3":
        return codes.view(torch.float8_e4m3fn).float()
    return decode(codes, element).float() + 0.0  # e2m1 0x8 -> +0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("scheme", QUANTIZED, ids=[s.name for s in QUANTIZED])
@pytest.mark.interpreter
def test_decoded_output_is_each_code_times_its_group_scale_exactly(scheme: Scheme, dtype: torch.dtype) -> None:
    """The pre-pass's decoded mode (the GEMM then reads the values like a 16-bit input): each
    value equals the code's value times its stored group scale (or alone for per-token and
    static scales), in the dot's dtype, wherever ``decoded_dtype`` allows that dtype."""
    from qscheme.formats import decode
    from qscheme.triton.act_quant import decoded_dtype

    spec = specialize(scheme)
    activation = scheme.activation
    assert activation is not None
    allowed = decoded_dtype(spec, dtype)
    if activation.granularity == "group" and activation.format == "e4m3":
        assert allowed is None  # e4m3 times a float group scale is exact in no float dtype
        return
    if activation.scale_format == "e8m0" and dtype == torch.float16:
        assert allowed is None  # e8m0 scales reach beyond float16's range
        return
    assert allowed == dtype
    generator = torch.Generator().manual_seed(5)
    x = (torch.randn(5, 300, generator=generator) * torch.logspace(-3, 2, 300)).to(torch.bfloat16)
    x[1, :64] = 0
    _, static, divisor = _static_scales(scheme)
    codes = quantize_input(x, spec, static_scale=static, divisor=divisor)
    decoded = quantize_input(x, spec, static_scale=static, divisor=divisor, decoded=dtype)
    assert decoded.decoded and decoded.codes.dtype == dtype
    expected = _value_of(codes.codes, activation.format)
    if activation.granularity == "group":
        assert codes.scale is not None and decoded.scale is None
        scale = decode(
            codes.scale.view(torch.float8_e4m3fn) if activation.scale_format == "e4m3" else codes.scale,
            activation.scale_format,
        )
        expected = expected * scale.float().repeat_interleave(activation.group_size or 1, dim=1)[:, : x.shape[1]]
    elif activation.dynamic:  # per token: the scale stays with the GEMM's epilogue
        assert decoded.scale is not None and torch.equal(decoded.scale, codes.scale)
    assert torch.equal(expected.to(dtype).float(), expected)  # exact in the dtype
    assert torch.equal(decoded.codes.float(), expected)


def test_decoded_output_refuses_a_dtype_it_is_not_exact_in() -> None:
    from qscheme.errors import QuantizeError

    scheme = _scheme("compressed-tensors/MXFP4")
    with pytest.raises(QuantizeError, match=r"cannot decode this activation quantization exactly in torch\.float16"):
        quantize_input(torch.ones(2, 64), specialize(scheme), decoded=torch.float16)
