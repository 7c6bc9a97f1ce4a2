"""Which stored scale values can dequantize: masks over scale tensors as checkpoints store them.

A scale tensor is float32 / float16 / bfloat16, an fp8 dtype, or ``uint8`` holding e8m0
exponent bytes (every byte a power of two except 0xFF, which is NaN). The fp8 and e8m0 tests
read the bytes, so no conversion is needed to find NaN or a sign; the ``any_*`` forms decide
the common all-good case in one min/max pass. The loader refuses NaN / inf and negative block
scales (``qscheme.tensor_checks``); ``quantize_weight`` refuses every scale that is not
finite and > 0 (``qscheme.quantize.checks``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from qscheme.formats.elements import E8M0_NAN

_E4M3_NAN = 0x7F  # and 0xFF, its negative; e4m3fn has no infinity
_E5M2_EXPONENT = 0x7C  # all exponent bits set: inf or NaN


def nonfinite(value: Tensor) -> Tensor:
    """True where a stored scale is NaN or infinite (fp8 and e8m0 bytes included)."""
    if value.dtype == torch.float8_e4m3fn:
        raw = value.view(torch.uint8)
        return (raw & 0x7F) == _E4M3_NAN
    if value.dtype == torch.float8_e5m2:
        return (value.view(torch.uint8) & _E5M2_EXPONENT) == _E5M2_EXPONENT
    if value.dtype == torch.uint8:
        return value == E8M0_NAN
    if value.is_floating_point():
        return ~torch.isfinite(value)
    return torch.zeros_like(value, dtype=torch.bool)


def any_nonfinite(value: Tensor) -> bool:
    """``nonfinite(value).any()`` by max passes over the bytes for fp8 and e8m0, with no mask:
    e4m3 NaN is 0x7F (the largest byte as int8) or 0xFF (the largest as uint8); e8m0 NaN is
    0xFF, the largest byte."""
    if value.numel() == 0:
        return False
    if value.dtype == torch.float8_e4m3fn:
        raw = value.reshape(-1)
        return int(raw.view(torch.int8).max()) == _E4M3_NAN or int(raw.view(torch.uint8).max()) == 0xFF
    if value.dtype == torch.uint8:
        return int(value.max()) == E8M0_NAN
    return bool(nonfinite(value).any())


def negative(value: Tensor) -> Tensor:
    """True where a stored scale is below zero (-0.0 and NaN excluded; e8m0 bytes have no sign)."""
    if value.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return (value.view(torch.uint8) >= 0x81) & ~nonfinite(value)
    if value.dtype in (torch.uint8, torch.bool):
        return torch.zeros_like(value, dtype=torch.bool)
    return value < 0


def any_negative(value: Tensor) -> bool:
    """``negative(value).any()``: fp8 bytes with the sign bit set are negative as int8, so one
    min pass decides the common all-positive case."""
    if value.numel() == 0 or value.dtype in (torch.uint8, torch.bool):
        return False
    if value.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        if int(value.reshape(-1).view(torch.int8).min()) >= 0:
            return False
        return bool(negative(value).any())
    return bool(value.min() < 0)


def not_positive(value: Tensor) -> Tensor:
    """True where a stored scale is not a finite number > 0 (zero, negative, NaN or inf)."""
    if value.dtype == torch.uint8:  # e8m0: every other byte is a power of two
        return value == E8M0_NAN
    as_float = value if value.dtype == torch.float64 else value.to(torch.float32)
    return ~(as_float > 0) | torch.isinf(as_float)
