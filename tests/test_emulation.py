"""Activation emulation: bit-identical to compressed-tensors' own fake quantization (the forward
path it runs for a layer's input, dynamic scales from compute_dynamic_scales_and_zp), to a
transcription of ModelOpt's NVFP4 activation kernel, codes that are nearest values, and errors."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from qscheme.catalog import load_catalog, load_scheme
from qscheme.descriptor import ActivationSpec
from qscheme.emulation import (
    SUPPORTED_ACTIVATIONS,
    QuantizedActivation,
    activation_rule,
    apply_pre_scale,
    fake_quantize_activation,
    quantize_activation,
)
from qscheme.errors import QuantizeError
from qscheme.formats import decode, representable_values

compressed_tensors = pytest.importorskip("compressed_tensors")

from compressed_tensors.quantization import QuantizationStatus, preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import forward_quantize, quantize  # noqa: E402
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp, generate_gparam  # noqa: E402

# compressed-tensors preset -> the built-in scheme describing the same activations
PRESET_SCHEMES = {
    "NVFP4": "compressed-tensors/NVFP4",
    "MXFP4": "compressed-tensors/MXFP4",
    "FP8": "compressed-tensors/FP8",
    "FP8_DYNAMIC": "compressed-tensors/FP8_DYNAMIC",
    "FP8_BLOCK": "compressed-tensors/FP8_BLOCK",
    "W8A8": "compressed-tensors/W8A8",
}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HIDDEN = 256  # a multiple of every group size (16, 32, 128)


# --- oracles ----------------------------------------------------------------------------------


class _Layer(torch.nn.Module):
    """The attributes compressed-tensors' forward_quantize reads from a quantized Linear."""

    def __init__(self, **parameters: Tensor) -> None:
        super().__init__()
        self.quantization_status = QuantizationStatus.FROZEN
        for name, value in parameters.items():
            self.register_parameter(name, torch.nn.Parameter(value, requires_grad=False))


def _input_args(preset: str):
    return preset_name_to_scheme(preset, ["Linear"]).input_activations


def compressed_tensors_fake_quant(x: Tensor, preset: str, **parameters: Tensor) -> Tensor:
    """compressed-tensors' fake quantization of a layer input (its quantized forward's path).

    ``parameters`` are the layer's static ``input_scale`` / ``input_global_scale`` (a divisor).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return forward_quantize(_Layer(**parameters), x, "input", _input_args(preset))


def modelopt_nvfp4_fake_quant(x: Tensor, global_amax: Tensor) -> Tensor:
    """ModelOpt 0.47's NVFP4 activation fake quant, transcribed op for op from its Triton kernel
    (fp4_fake_quant_block + fp8_quantize_scale + fp4_round_magnitude), which needs CUDA."""
    x = x.float()
    global_scale = global_amax.float() / (6.0 * 448.0)
    global_scale = torch.where(global_scale > 0.0, global_scale, 1e-12)
    tile = x.unflatten(-1, (-1, 16))
    x_abs = tile.abs()
    block_max = x_abs.amax(dim=-1, keepdim=True)
    scale = torch.minimum(block_max / (6.0 * global_scale), torch.tensor(448.0))
    scale = scale.to(torch.float8_e4m3fn).to(torch.float32) * global_scale
    scale = torch.where(scale >= 1e-5, scale, 1.0)
    a = x_abs / scale
    magnitude = torch.where(
        a <= 0.25,
        0.0,
        torch.where(
            a < 0.75,
            0.5,
            torch.where(
                a <= 1.25,
                1.0,
                torch.where(
                    a < 1.75,
                    1.5,
                    torch.where(a <= 2.5, 2.0, torch.where(a < 3.5, 3.0, torch.where(a <= 5.0, 4.0, 6.0))),
                ),
            ),
        ),
    )
    rescaled = magnitude * scale
    return torch.where(tile >= 0, rescaled, -rescaled).flatten(-2)


# --- inputs -----------------------------------------------------------------------------------


def activations(dtype: torch.dtype, seed: int, shape: tuple[int, ...] = (3, 7, HIDDEN)) -> Tensor:
    """[batch, seq, hidden] with per-token magnitudes over 2**±6, a zero token, a zero group,
    outliers, tiny values and exact ties of every rounding."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator)
    x = x * torch.exp2(torch.randint(-6, 7, (*shape[:-1], 1), generator=generator).float())
    x[0, 0] = 0.0  # a zero token
    x[1, 2, :32] = 0.0  # zero groups in a non-zero token
    x[2, 3, 5] *= 1000.0  # outliers
    x[0, 1, 200] = -3.0e4
    x[2, 4, 17:50] *= 1e-6  # tiny values next to normal ones
    x[1, 5, :] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]).repeat(HIDDEN // 8)  # e2m1 ties
    x[1, 6, ::2] = -x[1, 6, ::2]
    return x.to(dtype)


def _static_parameters(preset: str, x: Tensor) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(our keyword arguments, compressed-tensors layer parameters) calibrated on x."""
    x = x.float()
    if preset == "FP8":
        scale = (x.abs().amax() / 448.0).reshape(1)
        return {"input_scale": scale}, {"input_scale": scale}
    if preset == "NVFP4":
        divisor = generate_gparam(x.amin(), x.amax())
        return {"input_global_scale_divisor": divisor}, {"input_global_scale": divisor}
    return {}, {}


def _activation(preset: str) -> ActivationSpec:
    activation = load_scheme(PRESET_SCHEMES[preset]).activation
    assert activation is not None
    return activation


# --- bit-identical to compressed-tensors -----------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("preset", list(PRESET_SCHEMES))
def test_matches_compressed_tensors_fake_quantization(preset: str, dtype: torch.dtype) -> None:
    for seed in range(3):
        x = activations(dtype, seed)
        ours_kwargs, layer_parameters = _static_parameters(preset, x)
        got = fake_quantize_activation(x, _activation(preset), **ours_kwargs)
        expected = compressed_tensors_fake_quant(x.float(), preset, **layer_parameters)
        assert got.dtype == torch.float32 and got.shape == x.shape
        assert torch.equal(got, expected), f"{preset} {dtype} seed {seed}: {(got != expected).sum()} differ"


@pytest.mark.parametrize("divisor", [1.0, 37.0, 2688.0 / 3.0, 1.0e6, 3.0e9])
def test_nvfp4_matches_compressed_tensors_for_any_global_scale(divisor: float) -> None:
    """Saturated block scales (small divisors) and block scales that underflow to zero and are
    replaced by 0.125 (huge divisors) included."""
    x = activations(torch.float32, seed=7)
    divisor_tensor = torch.tensor([divisor])
    got = fake_quantize_activation(x, _activation("NVFP4"), input_global_scale_divisor=divisor_tensor)
    expected = compressed_tensors_fake_quant(x, "NVFP4", input_global_scale=divisor_tensor)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("preset", list(PRESET_SCHEMES))
def test_codes_and_scales_match_compressed_tensors(preset: str) -> None:
    """The codes are compressed-tensors' quantized values and the scales its (dynamic) scales."""
    x = activations(torch.float32, seed=11)
    args = _input_args(preset)
    ours_kwargs, layer_parameters = _static_parameters(preset, x)
    q = quantize_activation(x, _activation(preset), **ours_kwargs)
    global_scale = layer_parameters.get("input_global_scale")
    if args.dynamic:
        scale, zero_point = compute_dynamic_scales_and_zp(x, args, _Layer(), global_scale=global_scale)
    else:
        scale, zero_point = layer_parameters["input_scale"], None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        values = quantize(x, scale, zero_point, args, global_scale=global_scale)
    assert torch.equal(decode(q.codes, q.format), values)
    # compressed-tensors keeps NVFP4 block scales as e4m3 values and MX scales as 2**(byte - 127)
    stored = decode(q.scale, "e4m3") if q.scale_format == "e4m3" else q.block_scale()
    assert torch.equal(stored, scale.float().reshape(stored.shape))


def test_compressed_tensors_computes_16_bit_inputs_in_their_dtype() -> None:
    """Quirk: given bf16, compressed-tensors computes amax / 448 and x / scale in bf16 and returns
    bf16; we (and deployed kernels) compute in float32, which equals its result for x.float()."""
    x = activations(torch.bfloat16, seed=0)
    ours = fake_quantize_activation(x, _activation("FP8_DYNAMIC"))
    in_bf16 = compressed_tensors_fake_quant(x, "FP8_DYNAMIC")
    assert in_bf16.dtype == torch.bfloat16
    assert not torch.equal(ours.to(torch.bfloat16), in_bf16)
    assert torch.equal(ours, compressed_tensors_fake_quant(x.float(), "FP8_DYNAMIC"))
    # MXFP4's power-of-two arithmetic is exact in bf16, so there the two agree.
    mx = fake_quantize_activation(x, _activation("MXFP4"))
    assert torch.equal(mx.to(torch.bfloat16), compressed_tensors_fake_quant(x, "MXFP4"))
    # ... but in fp16 a group whose amax is an fp16 subnormal gets scale 1.0 there: all zeros.
    tiny = torch.full((1, 1, 32), 1.0e-5, dtype=torch.float16)
    assert not bool(compressed_tensors_fake_quant(tiny, "MXFP4").any())
    assert torch.equal(
        fake_quantize_activation(tiny, _activation("MXFP4")), compressed_tensors_fake_quant(tiny.float(), "MXFP4")
    )
    assert bool(fake_quantize_activation(tiny, _activation("MXFP4")).all())


@pytest.mark.parametrize("preset", ["FP8_DYNAMIC", "W8A8"])
def test_per_token_is_per_row_of_the_last_dim_for_any_rank(preset: str) -> None:
    """Quirk: compressed-tensors' per-token strategy treats 2-D input as ONE token (per tensor)."""
    x = activations(torch.float32, seed=3)
    tokens = x.reshape(-1, HIDDEN)
    activation = _activation(preset)
    expected = compressed_tensors_fake_quant(x, preset)
    assert torch.equal(fake_quantize_activation(tokens, activation), expected.reshape(-1, HIDDEN))
    assert torch.equal(
        fake_quantize_activation(x.reshape(3, 7, 1, HIDDEN), activation), expected.reshape(3, 7, 1, HIDDEN)
    )
    assert torch.equal(fake_quantize_activation(tokens[4], activation), expected.reshape(-1, HIDDEN)[4])
    assert not torch.equal(compressed_tensors_fake_quant(tokens, preset), expected.reshape(-1, HIDDEN))


@pytest.mark.parametrize("preset", ["NVFP4", "MXFP4", "FP8_BLOCK"])
def test_ragged_last_group_is_zero_padded(preset: str) -> None:
    """compressed-tensors rejects K % group != 0; we quantize as if K were zero-padded."""
    x = activations(torch.float32, seed=5)
    k = HIDDEN - 40
    ours_kwargs, layer_parameters = _static_parameters(preset, x)
    q = quantize_activation(x[..., :k], _activation(preset), **ours_kwargs)
    padded = torch.nn.functional.pad(x[..., :k], (0, 40))
    expected = compressed_tensors_fake_quant(padded, preset, **layer_parameters)[..., :k]
    group = q.group_size
    assert group is not None and q.codes.shape == (3, 7, k) and q.scale.shape == (3, 7, -(-k // group))
    assert torch.equal(q.dequantize(), expected)


# --- ModelOpt's arithmetic (multiplier only) ----------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nvfp4_multiplier_matches_modelopt_arithmetic(dtype: torch.dtype) -> None:
    activation = load_scheme("modelopt/NVFP4").activation
    assert activation is not None
    for seed in range(3):
        x = activations(dtype, seed)
        x[2, 4, 17:50] = 1.0  # no group below ModelOpt's 1e-5 effective-scale cut-off (next test)
        amax = x.float().abs().amax()
        input_scale = amax / 2688.0  # what ModelOpt exports as the NVFP4 input_scale
        got = fake_quantize_activation(x, activation, input_global_scale=input_scale)
        assert torch.equal(got, modelopt_nvfp4_fake_quant(x, amax))


def test_modelopt_zeroes_groups_below_its_effective_scale_cutoff_we_do_not() -> None:
    x = torch.full((1, 1, 16), 3.0e-5)
    x[..., 0] = 6.0e-5
    amax = torch.tensor(2.688)  # global scale 1e-3
    ours = fake_quantize_activation(x, _activation("NVFP4"), input_global_scale=(amax / 2688.0).reshape(1))
    assert torch.equal(modelopt_nvfp4_fake_quant(x, amax), torch.zeros_like(x))
    assert bool((ours > 0).all())


def test_nvfp4_divisor_and_multiplier_paths_agree_on_codes() -> None:
    """With g = 1 / D the codes agree; values differ in the last bit (block / D vs block * g).
    A block scale that rounds to zero stays zero on the multiplier path (0.125 on the divisor's)."""
    x = activations(torch.float32, seed=2)
    divisor = generate_gparam(x.amin(), x.amax())
    by_divisor = quantize_activation(x, _activation("NVFP4"), input_global_scale_divisor=divisor)
    by_multiplier = quantize_activation(x, _activation("NVFP4"), input_global_scale=torch.reciprocal(divisor))
    underflowed = by_multiplier.scale.float() == 0  # zero groups, and groups far below the global amax
    assert bool(underflowed.any()) and bool((by_divisor.scale.float()[underflowed] == 0.125).all())
    assert torch.equal(by_divisor.scale[~underflowed].float(), by_multiplier.scale[~underflowed].float())
    kept = ~underflowed.repeat_interleave(16, dim=-1)
    assert torch.equal(by_divisor.codes[kept], by_multiplier.codes[kept])
    # where the block scale underflowed both give zeros (the divisor path keeps the sign: code 0x8)
    assert not bool(by_divisor.dequantize()[~kept].any()) and not bool(by_multiplier.codes[~kept].any())
    assert torch.allclose(by_divisor.dequantize(), by_multiplier.dequantize(), rtol=2**-22, atol=0)
    both = quantize_activation(
        x, _activation("NVFP4"), input_global_scale=torch.reciprocal(divisor), input_global_scale_divisor=divisor
    )
    assert torch.equal(both.dequantize(), by_divisor.dequantize())


# --- the quantized form -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("preset", "codes_dtype", "scale_dtype", "scale_shape"),
    [
        ("NVFP4", torch.uint8, torch.float8_e4m3fn, (2, 5, HIDDEN // 16)),
        ("MXFP4", torch.uint8, torch.uint8, (2, 5, HIDDEN // 32)),
        ("FP8", torch.float8_e4m3fn, torch.float32, (1,)),
        ("FP8_DYNAMIC", torch.float8_e4m3fn, torch.float32, (2, 5, 1)),
        ("FP8_BLOCK", torch.float8_e4m3fn, torch.float32, (2, 5, HIDDEN // 128)),
        ("W8A8", torch.int8, torch.float32, (2, 5, 1)),
    ],
)
def test_quantized_form(
    preset: str, codes_dtype: torch.dtype, scale_dtype: torch.dtype, scale_shape: tuple[int, ...]
) -> None:
    x = activations(torch.bfloat16, seed=1)[:2, :5]
    ours_kwargs, _ = _static_parameters(preset, x)
    q = quantize_activation(x, _activation(preset), **ours_kwargs)
    assert isinstance(q, QuantizedActivation)
    assert (q.codes.dtype, tuple(q.codes.shape)) == (codes_dtype, tuple(x.shape))
    assert (q.scale.dtype, tuple(q.scale.shape)) == (scale_dtype, scale_shape)
    if q.format == "e2m1":
        assert int(q.codes.max()) <= 15
    assert (q.global_scale is not None) == (preset == "NVFP4")
    assert torch.equal(q.dequantize(), fake_quantize_activation(x, _activation(preset), **ours_kwargs))
    assert torch.equal(q.dequantize(), decode(q.codes, q.format) * q.effective_scale())
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.codes = q.codes  # type: ignore[misc]


def test_every_builtin_scheme_with_quantized_activations_is_supported() -> None:
    schemes = [scheme for scheme in load_catalog(include_plugins=False) if scheme.activation is not None]
    assert len(schemes) >= 8
    for scheme in schemes:
        assert scheme.activation is not None
        assert activation_rule(scheme.activation) in SUPPORTED_ACTIVATIONS, scheme.name


def test_apply_pre_scale() -> None:
    x = activations(torch.bfloat16, seed=4)
    pre_scale = torch.rand(HIDDEN, dtype=torch.bfloat16) + 0.5
    got = apply_pre_scale(x, pre_scale)
    assert got.dtype == torch.float32
    assert torch.equal(got, x.float() * pre_scale.float())


# --- properties -------------------------------------------------------------------------------


def _nearest_distance(target: Tensor, values: Tensor) -> Tensor:
    """Distance from each target to its nearest representable value (beyond the range: the end)."""
    target = target.double().clamp(float(values[0]), float(values[-1]))
    return (target[..., None] - values.double()).abs().amin(dim=-1)


RULE_INPUTS = {
    "NVFP4": {"input_global_scale": 1.0e-3},
    "MXFP4": {},
    "FP8 per tensor": {"input_scale": 2.0e-2},
    "FP8 per token": {},
    "FP8 per group": {},
    "int8 per token": {},
}


def _spec(rule_name: str) -> ActivationSpec:
    rule = next(rule for rule in SUPPORTED_ACTIVATIONS if rule.name == rule_name)
    return ActivationSpec(
        format=rule.format,
        granularity=rule.granularity,
        dynamic=rule.dynamic,
        scale_format=rule.scale_formats[0],
        group_size=rule.group_size,
    )


@st.composite
def _token_batches(draw: st.DrawFn) -> Tensor:
    rows = draw(st.integers(1, 3))
    k = draw(st.integers(1, 140))
    element = st.floats(-1.0e4, 1.0e4, width=32, allow_subnormal=True)
    flat = draw(st.lists(element, min_size=rows * k, max_size=rows * k))
    exponents = draw(st.lists(st.integers(-40, 20), min_size=rows, max_size=rows))
    x = torch.tensor(flat, dtype=torch.float32).reshape(rows, k)
    x = x * torch.exp2(torch.tensor(exponents, dtype=torch.float32))[:, None]
    dtype = draw(st.sampled_from(DTYPES))
    largest = torch.finfo(dtype).max
    return x.clamp(-largest, largest).to(dtype)


@settings(max_examples=60, deadline=None)
@given(rule_name=st.sampled_from(list(RULE_INPUTS)), x=_token_batches(), scale_exponent=st.integers(-8, 8))
def test_codes_decode_to_the_nearest_representable_value(rule_name: str, x: Tensor, scale_exponent: int) -> None:
    kwargs = {name: torch.tensor([value * 2.0**scale_exponent]) for name, value in RULE_INPUTS[rule_name].items()}
    q = quantize_activation(x, _spec(rule_name), **kwargs)
    multiplier = q.effective_scale()
    assert bool((multiplier >= 0).all()) and bool(torch.isfinite(multiplier).all())
    target = torch.where(multiplier == 0, 0.0, x.float() / torch.where(multiplier == 0, 1.0, multiplier))
    decoded = decode(q.codes, q.format)
    values = representable_values(q.format)
    distance = (decoded.double() - target.double().clamp(float(values[0]), float(values[-1]))).abs()
    assert torch.equal(distance, _nearest_distance(target, values))
    assert torch.equal(q.dequantize(), decoded * multiplier)
    assert torch.equal(fake_quantize_activation(x, _spec(rule_name), **kwargs), q.dequantize())


@settings(max_examples=30, deadline=None)
@given(x=_token_batches(), shift=st.integers(-20, 20))
def test_mxfp4_commutes_with_powers_of_two(x: Tensor, shift: int) -> None:
    x = x.float()
    q = quantize_activation(x, _spec("MXFP4"))
    shifted = quantize_activation(x * 2.0**shift, _spec("MXFP4"))
    byte = q.scale.int()
    nonzero = (byte > 30) & (byte < 200)  # away from the e8m0 floor, float32 subnormals and overflow
    assert torch.equal(shifted.scale.int()[nonzero], byte[nonzero] + shift)
    rows = nonzero.repeat_interleave(32, dim=-1)[..., : x.shape[-1]]
    # values, not codes: a float32 subnormal shifted to zero loses the sign of its zero code
    assert torch.equal(decode(shifted.codes, "e2m1")[rows], decode(q.codes, "e2m1")[rows])


# --- errors -----------------------------------------------------------------------------------


SUPPORTED_LIST = (
    "supported activation quantizations are NVFP4 (e2m1, group 16, dynamic, scale e4m3); "
    "MXFP4 (e2m1, group 32, dynamic, scale e8m0); "
    "FP8 per tensor (e4m3, per tensor, static scale, scale fp32/float/bf16/fp16); "
    "FP8 per token (e4m3, per token, dynamic, scale fp32/float); "
    "FP8 per group (e4m3, group 128, dynamic, scale fp32/float); "
    "int8 per token (int8, per token, dynamic, scale fp32/float). "
    "Use a scheme with one of these, or 16-bit activations (no activation block)"
)


@pytest.mark.parametrize(
    ("spec", "described"),
    [
        (
            ActivationSpec("e4m3", "group", True, "fp32", group_size=64),
            "activation format 'e4m3', granularity 'group' (group_size 64), dynamic, scale format 'fp32'",
        ),
        (
            ActivationSpec("int8", "tensor", False, "fp32"),
            "activation format 'int8', granularity 'tensor', static, scale format 'fp32'",
        ),
        (
            ActivationSpec("e5m2", "token", True, "fp32"),
            "activation format 'e5m2', granularity 'token', dynamic, scale format 'fp32'",
        ),
        (
            ActivationSpec("e2m1", "group", True, "e8m0", group_size=16),
            "activation format 'e2m1', granularity 'group' (group_size 16), dynamic, scale format 'e8m0'",
        ),
    ],
)
def test_unsupported_activation_message(spec: ActivationSpec, described: str) -> None:
    with pytest.raises(QuantizeError) as raised:
        fake_quantize_activation(torch.ones(2, 32), spec)
    assert str(raised.value) == f"cannot emulate {described}: {SUPPORTED_LIST}"


@pytest.mark.parametrize(
    ("preset", "kwargs", "message"),
    [
        (
            "FP8",
            {},
            "FP8 per tensor (e4m3, per tensor, static scale, scale fp32/float/bf16/fp16) needs input_scale "
            "(the float32 multiplier CanonicalWeight.input_scale), got none",
        ),
        (
            "NVFP4",
            {},
            "NVFP4 (e2m1, group 16, dynamic, scale e4m3) needs input_global_scale (the float32 multiplier "
            "CanonicalWeight.input_global_scale) or input_global_scale_divisor (compressed-tensors' stored "
            "input_global_scale), got none",
        ),
        (
            "FP8_DYNAMIC",
            {"input_scale": torch.tensor([0.1])},
            "FP8 per token (e4m3, per token, dynamic, scale fp32/float) takes no static scale (it computes its "
            "scales), but input_scale was given; drop it, or check the scheme's activation block",
        ),
        (
            "FP8",
            {"input_scale": torch.tensor([0.1, 0.2])},
            "input_scale must hold one value, got shape (2,) (2 values); a fused layer with one input_scale per "
            "partition quantizes its shared input once: pass one value (engines use the partitions' maximum) or "
            "quantize the input per partition",
        ),
        (
            "NVFP4",
            {"input_global_scale": torch.tensor(0.0)},
            "input_global_scale must be a positive finite number, got 0.0; a zero or missing calibration cannot "
            "quantize activations: recalibrate or re-export",
        ),
        (
            "NVFP4",
            {"input_global_scale": torch.tensor([0.5]), "input_global_scale_divisor": torch.tensor([4.0])},
            "input_global_scale 0.5 and input_global_scale_divisor 4.0 are not reciprocals (product 2.0); pass "
            "the multiplier and the divisor of the same layer, or only one of them",
        ),
    ],
)
def test_scale_argument_messages(preset: str, kwargs: dict[str, Tensor], message: str) -> None:
    with pytest.raises(QuantizeError) as raised:
        quantize_activation(torch.ones(2, 32), _activation(preset), **kwargs)
    assert str(raised.value) == message


def test_input_messages() -> None:
    activation = _activation("FP8_DYNAMIC")
    with pytest.raises(QuantizeError, match=r"^the activation x has dtype torch.int32; activation quantization takes"):
        fake_quantize_activation(torch.ones(2, 4, dtype=torch.int32), activation)
    with pytest.raises(QuantizeError, match=r"K >= 1 input features, got shape \(\)"):
        fake_quantize_activation(torch.tensor(1.0), activation)
    with pytest.raises(QuantizeError) as raised:
        apply_pre_scale(torch.ones(2, 8), torch.ones(4))
    assert str(raised.value) == (
        "input_pre_scale has shape (4,); it must be [K] = [8], one multiplier per input feature of x (shape (2, 8))"
    )
