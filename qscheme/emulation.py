"""Exact activation quantization: the quantize-dequantize the reference kernel applies to a layer's input.

A scheme with quantized activations (``Scheme.activation``) quantizes the input of every linear
layer before the GEMM. This module computes that quantization bit for bit, vectorised, on any
``[..., K]`` input (scales are found per token over the LAST dim whatever the rank), in float32:

- ``quantize_activation`` returns the codes and scales a kernel consuming quantized activations
  must produce (``QuantizedActivation``), and ``QuantizedActivation.dequantize`` the values;
- ``fake_quantize_activation`` is the two together, the emulation reference;
- ``apply_pre_scale`` multiplies the input by an AWQ ``input_pre_scale`` first;
- ``prepare_input`` is the pre-scale and the fake quantization together, in the dtype a kernel
  multiplies (float32, or the float32 values rounded once to bfloat16): one native pass on a CPU.

Supported activation quantizations (``SUPPORTED_ACTIVATIONS``, the pairs deployed kernels run),
with the float32 arithmetic of each. ``amax`` is the absolute maximum of a token (or group),
``x`` the input upcast to float32, ``round`` the element format's round-to-nearest-even with
saturation (``qscheme.formats.encode``):

=============================  =====================================================================
NVFP4 (e2m1, group 16,         with ``input_global_scale_divisor`` D (compressed-tensors' stored
e4m3 block scales, static      ``input_global_scale``): block = e4m3(D * (amax / 6)), a zero block
global scale)                  replaced by 0.125; s = block / D; q = round(x / s); x' = q * s. This
                               is compressed-tensors' order of operations (calculate_qparams, then
                               _quantize_dequantize) and reproduces its fake quantization exactly.
                               With only the multiplier g (``input_global_scale``, ModelOpt's
                               ``input_scale`` = amax_x / 2688): block = e4m3(amax / (6 * g));
                               s = block * g; q = round(x / s); x' = q * s: ModelOpt's order
                               (``fp8_quantize_scale`` / ``fp4_fake_quant_block`` in
                               modelopt.torch.kernels.quantization) and the formula of
                               formats.md. A block scale that rounds to zero stays zero and gives
                               zero codes. With g = 1 / D the two give the same codes except where
                               D * (amax / 6) and amax / (6 * g) round apart (none seen in tests);
                               the values differ in the last bit (block / D vs block * g).
MXFP4 (e2m1, group 32,         byte = compressed-tensors' MX scale of amax
e8m0 scales)                   (``qscheme.formats.mx_scale_exponent``); s = 2**(byte - 127);
                               q = round(x / s); x' = q * s. Exact division and product.
FP8 static per tensor          s = input_scale (multiplier, amax / 448); q = e4m3(x / s); x' = q * s.
FP8 dynamic per token          s = amax / 448 (a zero s becomes float32 eps); q = e4m3(x / s).
FP8 dynamic per group of 128   as per token, per group of 128 along K.
int8 dynamic per token         s = amax / 127.5 (compressed-tensors' (127 - -128) / 2; a zero s
                               becomes float32 eps); q = clamp(round_half_even(x / s), -128, 127).
=============================  =====================================================================

Float32 on the exactly upcast input is what deployed kernels compute, and equals
compressed-tensors' fake quantization of ``x.float()`` bit for bit (tests/test_emulation.py).
compressed-tensors quirks this module deliberately does not copy:

- Run on a bf16 or fp16 tensor, compressed-tensors computes dynamic scales (``amax / 448``,
  ``amax / 6`` before the NVFP4 global scale, ``amax / 127.5``), ``x / s`` and ``q * s`` in that
  dtype and returns that dtype: in tests a quarter to two fifths of FP8/int8 per-token values
  and a few percent of NVFP4 values differ from the float32 result for bf16 input. MXFP4 is
  exact in bf16 and agrees; in fp16 it zeroes groups whose amax is an fp16 subnormal (below
  about 2**-14), where its power-of-two scale underflows to 0 and it substitutes 1.0. Static FP8
  with a float32 input_scale promotes to float32 and returns float32 even for a bf16 input,
  unlike the group strategies.
- Its per-token strategy reduces over every dim but the first two: per token only for 3-D
  ``[batch, seq, hidden]`` input; a 2-D ``[tokens, hidden]`` input is silently quantized per
  tensor. Here a token is always a row of the last dim.
- It rejects a K that is not a multiple of the group size; here a ragged last group is quantized
  as if zero-padded (as kernels that pad K do), and scales have ``ceil(K / group)`` columns.
- A negative value that rounds to zero gives -0.0 there and +0.0 here (e2m1 code 0x8 decodes
  to +0.0); the values compare equal.

ModelOpt's NVFP4 fake quantization (a CUDA-only Triton kernel) also replaces an effective scale
below 1e-5 by 1.0, which zeroes every group whose amax is below about 6e-5 whatever the global
scale; kernels that run NVFP4 GEMMs do not, and neither does this module. ModelOpt's FP8 fake
quantization computes ``e4m3(x * (448 / amax)) * (1 / (448 / amax))`` from its calibrated amax,
which the exported ``input_scale = amax / 448`` does not recover exactly; this module follows
compressed-tensors' ``x / input_scale`` for the static FP8 scale of both producers.

NaN and infinite inputs are not supported here (their groups' results are unspecified and
differ between kernels). ``QuantLinear`` checks its inputs before any kernel quantizes them: a
CPU input holding inf or NaN raises NonFiniteInputError naming the layer, and on other devices
the output rows of such inputs are NaN (``qscheme.input_checks``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

import torch
from torch import Tensor
from torch.nn import functional

from qscheme import emulation_native
from qscheme.descriptor import ActivationSpec
from qscheme.descriptor.model import ActivationGranularity
from qscheme.errors import FormatError, QuantizeError
from qscheme.formats import FORMAT_ALIASES, decode, encode, get_element_format, mx_scale_exponent
from qscheme.formats.table import range_half

__all__ = [
    "SUPPORTED_ACTIVATIONS",
    "ActivationRule",
    "QuantizedActivation",
    "activation_rule",
    "apply_pre_scale",
    "fake_quantize_activation",
    "native_input_pass",
    "prepare_input",
    "quantize_activation",
]

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FLOAT32_EPS = float(torch.finfo(torch.float32).eps)
# compressed-tensors replaces an NVFP4 block scale that rounds to zero by this e4m3 value.
_NVFP4_ZERO_BLOCK_SCALE = 0.125
# what each static-scale argument holds, for error messages
_SCALE_ARGUMENTS: Mapping[str, str] = MappingProxyType(
    {
        "input_scale": "the float32 multiplier CanonicalWeight.input_scale",
        "input_global_scale": "the float32 multiplier CanonicalWeight.input_global_scale",
        "input_global_scale_divisor": "compressed-tensors' stored input_global_scale",
    }
)
# A multiplier and a divisor given together must be reciprocals to within float32 rounding.
_RECIPROCAL_TOLERANCE = 2.0**-20

ScaleKind = Literal["static", "absmax", "nvfp4", "mx"]
"""How a rule finds its scales (see `_SCALE_RULES`)."""


@dataclass(frozen=True)
class ActivationRule:
    """One supported activation quantization: the ActivationSpec it matches and its scale rule.

    ``range_half`` is compressed-tensors' ``(q_max - q_min) / 2``, the divisor of the absmax in
    a dynamic scale (448 for e4m3, 6 for e2m1, 127.5 for int8); ``scale_formats`` are the
    ``ActivationSpec.scale_format`` values accepted.
    """

    name: str
    format: str
    granularity: ActivationGranularity
    group_size: int | None
    dynamic: bool
    scale_formats: tuple[str, ...]
    scale_kind: ScaleKind
    range_half: float | None = None

    def describe(self) -> str:
        where = f"group {self.group_size}" if self.granularity == "group" else f"per {self.granularity}"
        timing = "dynamic" if self.dynamic else "static scale"
        return f"{self.name} ({self.format}, {where}, {timing}, scale {'/'.join(self.scale_formats)})"


_FLOAT_SCALES = ("fp32", "float")

SUPPORTED_ACTIVATIONS: tuple[ActivationRule, ...] = (
    ActivationRule("NVFP4", "e2m1", "group", 16, True, ("e4m3",), "nvfp4", range_half("e2m1")),
    ActivationRule("MXFP4", "e2m1", "group", 32, True, ("e8m0",), "mx"),
    ActivationRule("FP8 per tensor", "e4m3", "tensor", None, False, ("fp32", "float", "bf16", "fp16"), "static"),
    ActivationRule("FP8 per token", "e4m3", "token", None, True, _FLOAT_SCALES, "absmax", range_half("e4m3")),
    ActivationRule("FP8 per group", "e4m3", "group", 128, True, _FLOAT_SCALES, "absmax", range_half("e4m3")),
    ActivationRule("int8 per token", "int8", "token", None, True, _FLOAT_SCALES, "absmax", range_half("int8")),
)
"""Every activation quantization the emulation runs (see the module docstring for the math)."""


def _describe_spec(activation: ActivationSpec) -> str:
    granularity = repr(activation.granularity)
    if activation.group_size is not None:
        granularity += f" (group_size {activation.group_size})"
    timing = "dynamic" if activation.dynamic else "static"
    return (
        f"activation format {activation.format!r}, granularity {granularity}, {timing}, "
        f"scale format {activation.scale_format!r}"
    )


def _canonical_format(name: str) -> str:
    try:
        return get_element_format(name).name
    except FormatError:
        return name


def activation_rule(activation: ActivationSpec) -> ActivationRule:
    """The supported rule an ActivationSpec matches; QuantizeError naming the spec if none."""
    element = _canonical_format(activation.format)
    scale_format = FORMAT_ALIASES.get(activation.scale_format, activation.scale_format)
    for rule in SUPPORTED_ACTIVATIONS:
        if (
            rule.format == element
            and rule.granularity == activation.granularity
            and rule.dynamic == activation.dynamic
            and scale_format in rule.scale_formats
            and (rule.granularity != "group" or rule.group_size == activation.group_size)
        ):
            return rule
    supported = "; ".join(rule.describe() for rule in SUPPORTED_ACTIVATIONS)
    raise QuantizeError(
        f"cannot emulate {_describe_spec(activation)}: supported activation quantizations are "
        f"{supported}. Use a scheme with one of these, or 16-bit activations (no activation block)"
    )


# --- the quantized form ----------------------------------------------------------------------


@dataclass(frozen=True)
class QuantizedActivation:
    """Quantized activations in canonical form; ``dequantize()`` gives the fake-quantized values.

    - ``codes``: one per element, ``[..., K]``: e2m1 as uint8 codes 0..15 (bit 3 the sign,
      unpacked), e4m3 as float8_e4m3fn, int8 as int8.
    - ``scale``: NVFP4 float8_e4m3fn ``[..., ceil(K/16)]``; MXFP4 e8m0 bytes as uint8
      ``[..., ceil(K/32)]``; FP8 per group float32 ``[..., ceil(K/128)]``; per token float32
      ``[..., 1]``; per tensor float32 ``[1]``. Float scales are dequant multipliers.
    - ``global_scale``: NVFP4's float32 ``[1]`` multiplier (None otherwise).
    - ``global_scale_divisor``: NVFP4's float32 ``[1]`` divisor when one was given; the
      dequantization then divides by it (compressed-tensors' rounding) instead of multiplying
      by ``global_scale``.
    - ``format`` / ``scale_format`` / ``group_size``: the element and scale formats and the
      group size along K (None for per-tensor and per-token scales).
    """

    codes: Tensor
    scale: Tensor
    global_scale: Tensor | None
    format: str
    scale_format: str
    group_size: int | None = None
    global_scale_divisor: Tensor | None = None

    def block_scale(self) -> Tensor:
        """The float32 multiplier of each scale entry (same shape as ``scale``)."""
        return _block_multiplier(self.scale_format, self.scale, self.global_scale, self.global_scale_divisor)

    def effective_scale(self) -> Tensor:
        """The float32 multiplier of every element: ``dequantize() == decode(codes) * this``."""
        scale = self.block_scale()
        k = self.codes.shape[-1]
        if self.group_size is not None:
            scale = scale.repeat_interleave(self.group_size, dim=-1)[..., :k]
        return scale.expand(self.codes.shape)

    def dequantize(self) -> Tensor:
        """The dequantized values, float32 ``[..., K]``."""
        return decode(self.codes, self.format) * self.effective_scale()


def _float_multiplier(scale: Tensor, global_scale: Tensor | None, divisor: Tensor | None) -> Tensor:
    return scale.to(torch.float32)


def _e8m0_multiplier(scale: Tensor, global_scale: Tensor | None, divisor: Tensor | None) -> Tensor:
    return decode(scale, "e8m0")


def _nvfp4_multiplier(scale: Tensor, global_scale: Tensor | None, divisor: Tensor | None) -> Tensor:
    block = decode(scale, "e4m3")
    if divisor is not None:
        return block / divisor  # compressed-tensors: scale / global_scale
    if global_scale is None:
        raise QuantizeError("NVFP4 activations need a global scale (multiplier or divisor); both are None")
    return block * global_scale  # ModelOpt: fp8 block scale * global scale


# stored scale format -> the float32 multiplier of each stored scale entry
_MULTIPLIERS: Mapping[str, Callable[[Tensor, Tensor | None, Tensor | None], Tensor]] = MappingProxyType(
    {"e4m3": _nvfp4_multiplier, "e8m0": _e8m0_multiplier, "fp32": _float_multiplier}
)


def _block_multiplier(scale_format: str, scale: Tensor, global_scale: Tensor | None, divisor: Tensor | None) -> Tensor:
    return _MULTIPLIERS[scale_format](scale, global_scale, divisor)


# --- scale rules: stored scales of a [..., B, L] block view ----------------------------------


@dataclass(frozen=True)
class _Scales:
    """Validated static inputs of one call."""

    input_scale: Tensor | None
    global_scale: Tensor | None
    global_scale_divisor: Tensor | None


def _absmax(blocks: Tensor) -> Tensor:
    return blocks.abs().amax(dim=-1)


def _static_scale(rule: ActivationRule, blocks: Tensor, scales: _Scales) -> Tensor:
    assert scales.input_scale is not None  # checked by _validate_scales
    return scales.input_scale


def _absmax_scale(rule: ActivationRule, blocks: Tensor, scales: _Scales) -> Tensor:
    assert rule.range_half is not None
    scale = _absmax(blocks) / rule.range_half
    return torch.where(scale == 0, _FLOAT32_EPS, scale)  # compressed-tensors: eps of the scale dtype


def _nvfp4_scale(rule: ActivationRule, blocks: Tensor, scales: _Scales) -> Tensor:
    assert rule.range_half is not None
    amax = _absmax(blocks)
    if scales.global_scale_divisor is not None:
        block = encode(scales.global_scale_divisor * (amax / rule.range_half), "e4m3")
        zero = block.to(torch.float32) == 0
        return torch.where(zero, _NVFP4_ZERO_BLOCK_SCALE, block.to(torch.float32)).to(torch.float8_e4m3fn)
    assert scales.global_scale is not None
    return encode(amax / (rule.range_half * scales.global_scale), "e4m3")


def _mx_scale(rule: ActivationRule, blocks: Tensor, scales: _Scales) -> Tensor:
    return mx_scale_exponent(_absmax(blocks), rule.format)


_SCALE_RULES: Mapping[ScaleKind, Callable[[ActivationRule, Tensor, _Scales], Tensor]] = MappingProxyType(
    {"static": _static_scale, "absmax": _absmax_scale, "nvfp4": _nvfp4_scale, "mx": _mx_scale}
)

# the canonical scale_format of QuantizedActivation, by scale kind
_STORED_SCALE_FORMAT: Mapping[ScaleKind, str] = MappingProxyType(
    {"static": "fp32", "absmax": "fp32", "nvfp4": "e4m3", "mx": "e8m0"}
)


# --- validation --------------------------------------------------------------------------------


def _as_float32(x: Tensor, what: str) -> Tensor:
    return _checked_input(x, what).to(torch.float32)


def _checked_input(x: Tensor, what: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise QuantizeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        allowed = ", ".join(str(dtype) for dtype in _INPUT_DTYPES)
        raise QuantizeError(f"{what} has dtype {x.dtype}; activation quantization takes {allowed}")
    if x.ndim == 0 or x.shape[-1] == 0:
        raise QuantizeError(f"{what} must have shape [..., K] with K >= 1 input features, got shape {tuple(x.shape)}")
    return x


def _one_positive(value: Tensor | None, name: str, device: torch.device) -> Tensor | None:
    """A float32 [1] copy of a single positive finite scale, or None."""
    if value is None:
        return None
    if not isinstance(value, Tensor):
        raise QuantizeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.numel() != 1:
        raise QuantizeError(
            f"{name} must hold one value, got shape {tuple(value.shape)} ({value.numel()} values); "
            f"a fused layer with one {name} per partition quantizes its shared input once: pass one "
            f"value (engines use the partitions' maximum) or quantize the input per partition"
        )
    if not value.dtype.is_floating_point:
        raise QuantizeError(f"{name} must be a float tensor, got {value.dtype}")
    scale = value.detach().to(device=device, dtype=torch.float32).reshape(1)
    number = float(scale)
    if not number > 0 or number == float("inf"):
        raise QuantizeError(
            f"{name} must be a positive finite number, got {number}; "
            f"a zero or missing calibration cannot quantize activations: recalibrate or re-export"
        )
    return scale


def _validate_scales(
    rule: ActivationRule,
    device: torch.device,
    input_scale: Tensor | None,
    input_global_scale: Tensor | None,
    input_global_scale_divisor: Tensor | None,
) -> _Scales:
    scale = _one_positive(input_scale, "input_scale", device)
    global_scale = _one_positive(input_global_scale, "input_global_scale", device)
    divisor = _one_positive(input_global_scale_divisor, "input_global_scale_divisor", device)
    given = {
        "input_scale": scale is not None,
        "input_global_scale": global_scale is not None,
        "input_global_scale_divisor": divisor is not None,
    }
    needed: tuple[str, ...] = ()
    if rule.scale_kind == "static":
        needed = ("input_scale",)
    elif rule.scale_kind == "nvfp4":
        needed = ("input_global_scale", "input_global_scale_divisor")
    extra = [name for name, present in given.items() if present and name not in needed]
    if extra:
        takes = " or ".join(needed) if needed else "no static scale (it computes its scales)"
        raise QuantizeError(
            f"{rule.describe()} takes {takes}, but {', '.join(extra)} was given; "
            f"drop it, or check the scheme's activation block"
        )
    if needed and not any(given[name] for name in needed):
        wanted = " or ".join(f"{name} ({_SCALE_ARGUMENTS[name]})" for name in needed)
        raise QuantizeError(f"{rule.describe()} needs {wanted}, got none")
    if global_scale is not None and divisor is not None:
        product = float(global_scale * divisor)
        if abs(product - 1.0) > _RECIPROCAL_TOLERANCE:
            raise QuantizeError(
                f"input_global_scale {float(global_scale)} and input_global_scale_divisor "
                f"{float(divisor)} are not reciprocals (product {product}); pass the multiplier "
                f"and the divisor of the same layer, or only one of them"
            )
    if rule.scale_kind == "nvfp4" and global_scale is None:
        assert divisor is not None
        global_scale = torch.reciprocal(divisor)
    return _Scales(scale, global_scale, divisor)


# --- public API -----------------------------------------------------------------------------


def _blocks(values: Tensor, block_length: int) -> Tensor:
    """[..., K] -> [..., ceil(K / L), L], a ragged last block padded with zeros."""
    pad = -values.shape[-1] % block_length
    if pad:
        values = functional.pad(values, (0, pad))
    return values.unflatten(-1, (-1, block_length))


def quantize_activation(
    x: Tensor,
    activation: ActivationSpec,
    *,
    input_scale: Tensor | None = None,
    input_global_scale: Tensor | None = None,
    input_global_scale_divisor: Tensor | None = None,
) -> QuantizedActivation:
    """Quantize a layer input ``x`` ``[..., K]`` (float32, bf16 or fp16) as ``activation`` says.

    ``input_scale`` (static FP8) and ``input_global_scale`` (NVFP4) are float32 dequant
    multipliers holding one value (shape ``[]`` or ``[1]``), as ``CanonicalWeight`` keeps them.
    For NVFP4, ``input_global_scale_divisor`` (compressed-tensors' stored input_global_scale)
    may be given instead of or with the multiplier, to reproduce compressed-tensors' rounding
    bit for bit; the module docstring gives the arithmetic of each. Raises QuantizeError for
    an unsupported activation spec, a missing, extra or non-positive scale, or a bad input.
    """
    rule = activation_rule(activation)
    values = _as_float32(x, "the activation x")
    scales = _validate_scales(rule, values.device, input_scale, input_global_scale, input_global_scale_divisor)
    k = values.shape[-1]
    blocks = _blocks(values, rule.group_size if rule.granularity == "group" and rule.group_size else k)

    stored_format = _STORED_SCALE_FORMAT[rule.scale_kind]
    scale = _SCALE_RULES[rule.scale_kind](rule, blocks, scales)  # [..., B]; [1] per tensor
    multiplier = _block_multiplier(stored_format, scale, scales.global_scale, scales.global_scale_divisor)
    multiplier = multiplier.unsqueeze(-1)  # broadcasts over each block's elements
    zero = multiplier == 0  # only an NVFP4 block scale that rounded to zero (multiplier path)
    quotient = torch.where(zero, 0.0, blocks / torch.where(zero, 1.0, multiplier))
    return QuantizedActivation(
        codes=encode(quotient, rule.format).flatten(-2)[..., :k],
        scale=scale,
        global_scale=scales.global_scale,
        format=rule.format,
        scale_format=stored_format,
        group_size=rule.group_size if rule.granularity == "group" else None,
        global_scale_divisor=scales.global_scale_divisor,
    )


def fake_quantize_activation(
    x: Tensor,
    activation: ActivationSpec,
    *,
    input_scale: Tensor | None = None,
    input_global_scale: Tensor | None = None,
    input_global_scale_divisor: Tensor | None = None,
) -> Tensor:
    """``x`` quantized then dequantized: float32, the shape of ``x``.

    The same arguments and errors as ``quantize_activation``; equals
    ``quantize_activation(...).dequantize()``, bit for bit. On a CPU, the FP8 and int8 rules run
    in one native pass (``qscheme.emulation_native``) where the extension is built.
    """
    rule = activation_rule(activation)
    if rule.name in emulation_native.MODES:
        checked = _checked_input(x, "the activation x")
        scales = _validate_scales(rule, checked.device, input_scale, input_global_scale, input_global_scale_divisor)
        fast = emulation_native.fake_quantize(checked, rule, scales.input_scale)
        if fast is not None:
            return fast
    return quantize_activation(
        x,
        activation,
        input_scale=input_scale,
        input_global_scale=input_global_scale,
        input_global_scale_divisor=input_global_scale_divisor,
    ).dequantize()


def activation_codes(
    x: Tensor, activation: ActivationSpec, *, input_scale: Tensor | None = None
) -> tuple[Tensor, Tensor] | None:
    """For the FP8 per-tensor and per-token rules and the int8 per-token rule, on a CPU where the
    native pass runs (``qscheme.emulation_native``): the values of x's codes (float32, x's shape)
    and each token's float32 scale (``[..., 1]``), bit for bit ``decode(q.codes, q.format)`` and
    ``q.block_scale()`` of ``q = quantize_activation(x, activation, input_scale=...)``. None for
    any other rule or input (call ``quantize_activation`` then). The same errors as it.
    """
    rule = activation_rule(activation)
    if rule.name not in emulation_native.CODE_MODES:
        return None
    checked = _checked_input(x, "the activation x")
    scales = _validate_scales(rule, checked.device, input_scale, None, None)
    return emulation_native.activation_codes(checked, rule, scales.input_scale)


def apply_pre_scale(x: Tensor, pre_scale: Tensor) -> Tensor:
    """``x * pre_scale`` in float32: the AWQ ``input_pre_scale`` [K], applied before quantizing."""
    values = _as_float32(x, "the activation x")
    return values * _checked_pre_scale(pre_scale, tuple(values.shape)).to(device=values.device, dtype=torch.float32)


def _checked_pre_scale(pre_scale: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``pre_scale``, refused unless a float [K] tensor for inputs of ``shape`` [..., K]."""
    if not isinstance(pre_scale, Tensor) or not pre_scale.dtype.is_floating_point:
        raise QuantizeError(f"input_pre_scale must be a float tensor, got {pre_scale!r:.80}")
    k = shape[-1]
    if pre_scale.shape != (k,):
        raise QuantizeError(
            f"input_pre_scale has shape {tuple(pre_scale.shape)}; it must be [K] = [{k}], "
            f"one multiplier per input feature of x (shape {tuple(shape)})"
        )
    return pre_scale


def prepare_input(
    x: Tensor,
    activation: ActivationSpec | None,
    *,
    input_scale: Tensor | None = None,
    input_global_scale: Tensor | None = None,
    input_global_scale_divisor: Tensor | None = None,
    pre_scale: Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    threads: int = 1,
) -> Tensor:
    """The input a layer's weight multiplies, in ``dtype``: ``x`` times ``pre_scale``
    (``apply_pre_scale``) where it has one, then quantized and dequantized by ``activation``
    (``fake_quantize_activation``, with the same scale arguments and errors) where it has one.
    Bit for bit those functions' float32 result ``.to(dtype)``; ``x`` itself where there is
    nothing to apply and it has ``dtype`` already.

    On a CPU, for a float32 or bfloat16 ``dtype`` and the FP8 and int8 rules (or a pre-scale
    alone), one native pass computes it (``qscheme.emulation_native``), its rows shared out over
    ``threads`` workers.
    """
    checked = _checked_input(x, "the activation x")
    if activation is None and pre_scale is None:
        return checked if checked.dtype == dtype else checked.to(torch.float32).to(dtype)
    scales = {
        "input_scale": input_scale,
        "input_global_scale": input_global_scale,
        "input_global_scale_divisor": input_global_scale_divisor,
    }
    found = native_input_pass(activation, checked.shape[-1], **scales, pre_scale=pre_scale)
    fast = None if found is None else emulation_native.apply_pass(checked, found, dtype, threads)
    if fast is not None:
        return fast
    values = _as_float32(checked, "the activation x") if pre_scale is None else apply_pre_scale(checked, pre_scale)
    if activation is not None:
        values = fake_quantize_activation(values, activation, **scales)
    return values.to(dtype)


def native_input_pass(
    activation: ActivationSpec | None,
    k: int,
    *,
    input_scale: Tensor | None = None,
    input_global_scale: Tensor | None = None,
    input_global_scale_divisor: Tensor | None = None,
    pre_scale: Tensor | None = None,
) -> emulation_native.InputPass | None:
    """``prepare_input``'s work for inputs of K features, as a pass a native kernel applies to each
    row of x itself (``qscheme.tile_gemm.gemm``): for the FP8 and int8 rules, or a pre-scale alone,
    on a CPU; None otherwise (no pre-scale and no rule, another rule, a pre-scale off the CPU).
    The same errors as ``prepare_input`` for bad scales."""
    if pre_scale is not None:
        pre_scale = _checked_pre_scale(pre_scale, (k,))
    if activation is None and pre_scale is None:
        return None
    rule = None if activation is None else activation_rule(activation)
    scale = None
    if rule is not None:
        if rule.name not in emulation_native.MODES:
            return None
        cpu = torch.device("cpu")  # a native pass runs there
        scale = _validate_scales(rule, cpu, input_scale, input_global_scale, input_global_scale_divisor).input_scale
    return emulation_native.input_pass(rule, scale, pre_scale)
