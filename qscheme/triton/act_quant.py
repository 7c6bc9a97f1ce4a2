"""The activation pre-pass: quantize a layer input in Triton, bit for bit as qscheme.emulation does.

One program quantizes one input row (token) over a chunk of K (per-group and static scales) or
the whole of K (per-token scales, found in a first sweep). All arithmetic is float32 on the
exactly upcast input with correctly rounded division (``tl.div_rn``), in the order
``qscheme.emulation`` gives for each rule; the only product that feeds an addition is exact
(a power-of-two scaling before rounding), so fused multiply-adds cannot change a result:

- NVFP4: block = e4m3(amax / (6 * g)), s = block * g with the global multiplier g; or, given
  compressed-tensors' divisor D, block = e4m3(D * (amax / 6)) (0.125 if it rounds to zero) and
  s = block / D; codes = e2m1(x / s) (zero when s is zero).
- MX: the e8m0 byte of ``qscheme.formats.mx_scale_exponent`` (float32 rules), s = 2**(byte-127).
- absmax (FP8 and int8 per token or group): s = amax / range_half, float32 eps when zero.
- static: s = the input scale.

Outputs, in the layout the GEMM consumes: codes [M, K] one per element (e2m1 and e4m3 as uint8
bits, int8 as int8) and scales [M, ceil(K/G)] (e4m3 / e8m0 bits as uint8, float32 otherwise)
or [M] float32 per token; static scales are not written (the GEMM folds them per output row).

Or, where the GEMM's dot dtype holds them exactly (``decoded_dtype``), the decoded values
instead of codes: each code's value times its group's stored scale (e2m1 times an e4m3 or e8m0
scale), or the code's value alone when the scale is per token or static (the GEMM's epilogue
or row multiplier applies it). These are the values the GEMM would decode from the codes in
every program of a row of output tiles; decoded once here, the GEMM reads them like a 16-bit
input. The codes behind them are the same.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from qscheme.errors import QuantizeError
from qscheme.triton.decode import decode_e4m3, decode_e8m0, decode_element
from qscheme.triton.launch import Launch, cdiv, next_power_of_2
from qscheme.triton.spec import (
    ACT_RULE_MX,
    ACT_RULE_NVFP4,
    ACT_RULE_STATIC,
    ACT_SCALE_PER_TOKEN,
    ACT_SCALE_TILED,
    ELEMENT_IDS,
    SCALE_EXACT_IN,
    SCALE_FORMAT_IDS,
    Specialization,
)

_RULE_NVFP4: tl.constexpr = tl.constexpr(ACT_RULE_NVFP4)
_RULE_MX: tl.constexpr = tl.constexpr(ACT_RULE_MX)
_SCALE_PER_TOKEN: tl.constexpr = tl.constexpr(ACT_SCALE_PER_TOKEN)
_SCALE_TILED: tl.constexpr = tl.constexpr(ACT_SCALE_TILED)
_E2M1: tl.constexpr = tl.constexpr(ELEMENT_IDS["e2m1"])
_E4M3: tl.constexpr = tl.constexpr(ELEMENT_IDS["e4m3"])
_FLOAT32_EPS: tl.constexpr = tl.constexpr(float(torch.finfo(torch.float32).eps))
_ROUNDING_MAGIC: tl.constexpr = tl.constexpr(12582912.0)  # 1.5 * 2**23: (v + c) - c rounds half to even
_NVFP4_ZERO_BLOCK_SCALE_BITS: tl.constexpr = tl.constexpr(0x20)  # e4m3 0.125


@triton.jit
def round_half_even(value):
    """float32 -> float32 rounded to an integer, ties to even (exact for |value| < 2**22)."""
    return (value + _ROUNDING_MAGIC) - _ROUNDING_MAGIC


@triton.jit
def encode_e2m1(value):
    """float32 -> e2m1 code (int32 0..15): nearest, ties to the even code, saturating at 6.

    The sign bit is ``value < 0`` (a negative value that rounds to zero gives 0x8); NaN gives 0.
    """
    magnitude = tl.where(value != value, 0.0, tl.abs(value))
    # Between codes i and i+1 a tie goes to the even code: strict above a midpoint after an
    # even code, inclusive after an odd one.
    index = (magnitude > 0.25).to(tl.int32) + (magnitude >= 0.75).to(tl.int32)
    index += (magnitude > 1.25).to(tl.int32) + (magnitude >= 1.75).to(tl.int32)
    index += (magnitude > 2.5).to(tl.int32) + (magnitude >= 3.5).to(tl.int32)
    index += (magnitude > 5.0).to(tl.int32)
    return index | tl.where(value < 0, 8, 0)


@triton.jit
def encode_e4m3(value):
    """float32 -> float8_e4m3fn bits (int32 0..255): nearest even, saturating at 448, sign kept."""
    sign = (value.to(tl.int32, bitcast=True) >> 24) & 0x80
    magnitude = tl.minimum(tl.abs(value), 448.0)
    subnormal = round_half_even(magnitude * 512.0).to(tl.int32)  # multiples of 2**-9 below 2**-6
    bits = magnitude.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
    return tl.where(magnitude < 0.015625, subnormal, normal) | sign


@triton.jit
def encode_int8(value):
    """float32 -> int8 value (int32): nearest even, saturating to [-128, 127]; NaN gives 0."""
    clamped = tl.minimum(tl.maximum(value, -128.0), 127.0)
    return tl.where(value != value, 0.0, round_half_even(clamped)).to(tl.int32)


@triton.jit
def mx_scale_byte(amax):
    """float32 absmax -> the e8m0 byte of qscheme.formats.mx_scale_exponent for e2m1 (int32)."""
    bits = amax.to(tl.int32, bitcast=True)
    exponent = tl.minimum((bits + (1 << 21)) >> 23, 255)
    byte = tl.minimum(tl.maximum(exponent - 2, 0), 255)  # 127 + log2(p) - floor(log2(6))
    byte = tl.where(exponent == 0, 0, byte)
    return tl.where(exponent == 255, 255, byte)


@triton.jit
def _multiplier(amax, static_ptr, RULE: tl.constexpr, RANGE_HALF: tl.constexpr, HAS_DIVISOR: tl.constexpr):
    """(stored scale: bits or float32, float32 multiplier) of each absmax (dynamic rules)."""
    if RULE == _RULE_NVFP4:
        if HAS_DIVISOR:
            divisor = tl.load(static_ptr)
            stored = encode_e4m3(divisor * tl.div_rn(amax, RANGE_HALF))
            stored = tl.where((stored & 0x7F) == 0, _NVFP4_ZERO_BLOCK_SCALE_BITS, stored)
            multiplier = tl.div_rn(decode_e4m3(stored), divisor)
        else:
            global_scale = tl.load(static_ptr)
            stored = encode_e4m3(tl.div_rn(amax, RANGE_HALF * global_scale))
            multiplier = decode_e4m3(stored) * global_scale
    elif RULE == _RULE_MX:
        stored = mx_scale_byte(amax)
        multiplier = decode_e8m0(stored)
    else:
        multiplier = tl.div_rn(amax, RANGE_HALF)
        multiplier = tl.where(multiplier == 0, _FLOAT32_EPS, multiplier)
        stored = multiplier
    return stored, multiplier


@triton.jit
def _encode(quotient, FORMAT: tl.constexpr):
    if FORMAT == _E2M1:
        return encode_e2m1(quotient)
    elif FORMAT == _E4M3:
        return encode_e4m3(quotient)
    else:
        return encode_int8(quotient)


@triton.jit
def _store_row(out_row, offsets, mask, codes, scale, DECODED: tl.constexpr, FORMAT: tl.constexpr):
    """Codes, or (``DECODED``) their values times ``scale`` (a float32 broadcastable to them;
    exact in the output dtype, which the host checked) in the output's dtype."""
    if DECODED:
        values = decode_element(codes, FORMAT) * scale
        tl.store(out_row + offsets, values.to(out_row.dtype.element_ty), mask=mask)
    else:
        tl.store(out_row + offsets, codes.to(out_row.dtype.element_ty), mask=mask)


@triton.jit
def _quotient(values, multiplier):
    zero = multiplier == 0
    return tl.where(zero, 0.0, tl.div_rn(values, tl.where(zero, 1.0, multiplier)))


@triton.jit
def _load_row(x_ptr, pre_ptr, offsets, mask, HAS_PRE_SCALE: tl.constexpr):
    values = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_PRE_SCALE:
        values = values * tl.load(pre_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    return values


@triton.jit
def quantize_activation_kernel(
    x_ptr,
    pre_scale_ptr,
    static_ptr,
    codes_ptr,
    scale_ptr,
    K,
    stride_x,
    stride_codes,
    stride_scale,
    A_FORMAT: tl.constexpr,
    A_SCALE: tl.constexpr,
    A_GROUP: tl.constexpr,
    A_RULE: tl.constexpr,
    A_RANGE_HALF: tl.constexpr,
    HAS_PRE_SCALE: tl.constexpr,
    HAS_DIVISOR: tl.constexpr,
    DECODED: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Quantize row ``program_id(0)`` of x; per-group and static programs cover one K chunk.

    ``DECODED``: ``codes_ptr`` receives the decoded values (see the module docstring) and tiled
    scales are not written (they are in the values)."""
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_x
    codes_row = codes_ptr + row * stride_codes
    if A_SCALE == _SCALE_TILED:
        GROUPS: tl.constexpr = BLOCK_K // A_GROUP
        group = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        offsets = group[:, None] * A_GROUP + tl.arange(0, A_GROUP)[None, :]
        mask = offsets < K
        values = _load_row(x_row, pre_scale_ptr, offsets, mask, HAS_PRE_SCALE)
        amax = tl.max(tl.abs(values), axis=1)
        stored, multiplier = _multiplier(amax, static_ptr, A_RULE, A_RANGE_HALF, HAS_DIVISOR)
        codes = _encode(_quotient(values, multiplier[:, None]), A_FORMAT)
        if DECODED:  # times the stored scale's value (the NVFP4 global part is the GEMM's)
            if A_RULE == _RULE_NVFP4:
                stored_value = decode_e4m3(stored)
            elif A_RULE == _RULE_MX:
                stored_value = decode_e8m0(stored)
            else:
                stored_value = stored
            _store_row(codes_row, offsets, mask, codes, stored_value[:, None], True, A_FORMAT)
        else:
            _store_row(codes_row, offsets, mask, codes, 1.0, False, A_FORMAT)
            tl.store(
                scale_ptr + row * stride_scale + group, stored.to(scale_ptr.dtype.element_ty), mask=group * A_GROUP < K
            )
    elif A_SCALE == _SCALE_PER_TOKEN:
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offsets = k0 + tl.arange(0, BLOCK_K)
            values = _load_row(x_row, pre_scale_ptr, offsets, offsets < K, HAS_PRE_SCALE)
            amax = tl.maximum(amax, tl.abs(values))
        stored, multiplier = _multiplier(tl.max(amax, axis=0), static_ptr, A_RULE, A_RANGE_HALF, HAS_DIVISOR)
        tl.store(scale_ptr + row * stride_scale, stored)
        for k0 in range(0, K, BLOCK_K):
            offsets = k0 + tl.arange(0, BLOCK_K)
            mask = offsets < K
            values = _load_row(x_row, pre_scale_ptr, offsets, mask, HAS_PRE_SCALE)
            codes = _encode(_quotient(values, multiplier), A_FORMAT)
            _store_row(codes_row, offsets, mask, codes, 1.0, DECODED, A_FORMAT)
    else:
        offsets = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = offsets < K
        values = _load_row(x_row, pre_scale_ptr, offsets, mask, HAS_PRE_SCALE)
        multiplier = tl.load(static_ptr)
        codes = _encode(_quotient(values, multiplier), A_FORMAT)
        _store_row(codes_row, offsets, mask, codes, 1.0, DECODED, A_FORMAT)


@dataclass(frozen=True)
class QuantizedInput:
    """The pre-pass output: codes [M, K] (or their decoded values: ``decoded``), scales
    ([M, ceil(K/G)], [M] or None; tiled scales are None when decoded)."""

    codes: Tensor
    scale: Tensor | None
    decoded: bool = False


_CODE_DTYPES = {ELEMENT_IDS["e2m1"]: torch.uint8, ELEMENT_IDS["e4m3"]: torch.uint8, ELEMENT_IDS["int8"]: torch.int8}
_SCALE_DTYPES = {SCALE_FORMAT_IDS["e4m3"]: torch.uint8, SCALE_FORMAT_IDS["e8m0"]: torch.uint8}


# Code values alone (per-token and static scales stay outside): e4m3 and int8 are exact in all.
_EXACT_CODES = (ELEMENT_IDS["e4m3"], ELEMENT_IDS["int8"], ELEMENT_IDS["e2m1"])


def decoded_dtype(spec: Specialization, dot_dtype: torch.dtype) -> torch.dtype | None:
    """``dot_dtype`` when the pre-pass can hand the GEMM decoded values exactly in it (see the
    module docstring), else None (codes: FP8 per group with float scales, whose products are
    not exact in any float dtype, and e8m0 scales with a float16 dot)."""
    if not spec.A_QUANTIZED:
        return None
    exact: Collection[torch.dtype] = ()
    if spec.A_SCALE == ACT_SCALE_TILED:  # e2m1 codes times a bit-coded group scale
        if spec.A_FORMAT == ELEMENT_IDS["e2m1"]:
            exact = SCALE_EXACT_IN.get(spec.A_SCALE_FORMAT, ())
    elif spec.A_FORMAT in _EXACT_CODES:
        exact = (torch.float32, torch.bfloat16, torch.float16)
    return dot_dtype if dot_dtype in exact else None


def quantize_launch(
    x: Tensor,
    spec: Specialization,
    *,
    static_scale: Tensor | None = None,
    divisor: bool = False,
    pre_scale: Tensor | None = None,
    block_k: int = 1024,
    decoded: torch.dtype | None = None,
) -> tuple[Launch, QuantizedInput]:
    """The pre-pass launch for ``x`` [M, K] and the (empty) outputs it fills; see ``quantize_input``."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise QuantizeError(f"the activation pre-pass takes [M, K] with contiguous rows, got shape {tuple(x.shape)}")
    if spec.A_RULE in (ACT_RULE_NVFP4, ACT_RULE_STATIC) and static_scale is None:
        raise QuantizeError("this activation quantization needs its static scale (global scale or input scale)")
    if decoded is not None and decoded_dtype(spec, decoded) != decoded:
        raise QuantizeError(f"the pre-pass cannot decode this activation quantization exactly in {decoded}")
    m, k = x.shape
    codes = torch.empty((m, k), dtype=decoded or _CODE_DTYPES[spec.A_FORMAT], device=x.device)
    scale: Tensor | None = None
    if spec.A_SCALE == ACT_SCALE_TILED:
        group = spec.A_GROUP
        block_k = max(group, min(block_k, next_power_of_2(k)))
        scale_dtype = _SCALE_DTYPES.get(spec.A_SCALE_FORMAT, torch.float32)
        if decoded is None:
            scale = torch.empty((m, cdiv(k, group)), dtype=scale_dtype, device=x.device)
        grid = (m, cdiv(k, block_k))
    elif spec.A_SCALE == ACT_SCALE_PER_TOKEN:
        block_k = min(block_k, next_power_of_2(k))
        scale = torch.empty((m,), dtype=torch.float32, device=x.device)
        grid = (m, 1)
    else:
        block_k = min(block_k, next_power_of_2(k))
        grid = (m, cdiv(k, block_k))
    placeholder = codes  # any pointer, for arguments a specialisation does not read
    launch = Launch(
        kernel=quantize_activation_kernel,
        grid=grid,
        args={
            "x_ptr": x,
            "pre_scale_ptr": placeholder if pre_scale is None else pre_scale,
            "static_ptr": placeholder if static_scale is None else static_scale,
            "codes_ptr": codes,
            "scale_ptr": placeholder if scale is None else scale,
            "K": k,
            "stride_x": x.stride(0),
            "stride_codes": codes.stride(0),
            "stride_scale": 0 if scale is None else scale.stride(0),
        },
        constexprs={
            "A_FORMAT": spec.A_FORMAT,
            "A_SCALE": spec.A_SCALE,
            "A_GROUP": max(spec.A_GROUP, 1),
            "A_RULE": spec.A_RULE,
            "A_RANGE_HALF": spec.A_RANGE_HALF,
            "HAS_PRE_SCALE": pre_scale is not None,
            "HAS_DIVISOR": divisor,
            "DECODED": decoded is not None,
            "BLOCK_K": block_k,
        },
        num_warps=4,
        num_stages=1,
        label="activation pre-pass",
    )
    return launch, QuantizedInput(codes, scale, decoded is not None)


def quantize_input(
    x: Tensor,
    spec: Specialization,
    *,
    static_scale: Tensor | None = None,
    divisor: bool = False,
    pre_scale: Tensor | None = None,
    decoded: torch.dtype | None = None,
) -> QuantizedInput:
    """Quantize ``x`` [M, K] (contiguous rows) as ``spec`` says.

    ``static_scale`` is a float32 [1] tensor: the static input scale, or for NVFP4 the global
    multiplier (``divisor=False``) or compressed-tensors' divisor (``divisor=True``).
    ``pre_scale`` [K] multiplies x first (AWQ). ``decoded`` (a dtype ``decoded_dtype`` allows):
    write the decoded values in it instead of codes.
    """
    launch, outputs = quantize_launch(
        x, spec, static_scale=static_scale, divisor=divisor, pre_scale=pre_scale, decoded=decoded
    )
    if x.shape[0] > 0:
        launch.run()
    return outputs


__all__ = ["QuantizedInput", "decoded_dtype", "quantize_activation_kernel", "quantize_input", "quantize_launch"]
