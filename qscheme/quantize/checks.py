"""Checks that keep unusable scales out of ``quantize_weight``'s result.

A scale dequantizes nothing unless it is finite and > 0: zero, negative, NaN and infinite
scales, and e8m0's NaN byte 0xFF, are refused wherever they come from. Given scales are checked
where they are taken (``qscheme.quantize.given``); scales computed from a finite weight are
checked once written, because a producer's arithmetic can still overflow: compressed-tensors
computes scales in the weight's dtype (a float16 group near 65504 gives an infinite asymmetric
scale, or the e8m0 NaN byte), and an element at the top of its range times a scale near the
float32 maximum dequantizes to infinity. All-zero regions pass: both producers replace a zero
scale by a small positive one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from qscheme import api_checks
from qscheme.descriptor import Scheme
from qscheme.errors import QuantizeError
from qscheme.formats import decode
from qscheme.formats.elements import E8M0_NAN
from qscheme.formats.scale_values import not_positive
from qscheme.quantize.observe import ScaleLayout
from qscheme.quantize.rules import GivenScales, WeightPlan
from qscheme.scale_checks import (
    AMINMAX_DTYPES,
    FLOAT32_MAX,
    count_text,
    dequantizes_to_nonfinite,
    first_true,
    largest_element,
)

# what a meta weight or scale is told (``qscheme.api_checks.require_tensor`` refuses them)
META_FIX = f"meta tensors cannot be quantized: {api_checks.META_FIX}"


def require_positive(value: Tensor, scheme: Scheme, what: str, fix: str) -> None:
    """QuantizeError naming the first value of ``value`` that is not finite and > 0."""
    bad = not_positive(value)
    if bool(bad.any()):
        position, shown, count = _first_bad(value, bad)
        raise QuantizeError(
            f"scheme {scheme.name}: {what} must be finite and > 0, found {shown}{_at(position)} "
            f"({count_text(count, value.numel(), 'value')}); {fix}"
        )


def require_storable(given: Tensor, stored: Tensor, scheme: Scheme, what: str, fix: str) -> None:
    """QuantizeError when a finite, positive ``given`` value is not one once cast to ``stored``'s
    dtype (elementwise, same shape): it underflows to 0, overflows, or exceeds the dtype's range."""
    bad = not_positive(stored)
    if stored.dtype.is_floating_point:
        bad |= given.to(torch.float32) > torch.finfo(stored.dtype).max  # e4m3 casts saturate at 448
    if bool(bad.any()):
        position, shown, count = _first_bad(given, bad)
        _, kept, _ = _first_bad(stored, bad)
        raise QuantizeError(
            f"scheme {scheme.name}: {what} holds {shown}{_at(position)}, which becomes {kept} when stored as "
            f"{_dtype_name(stored.dtype)} ({count_text(count, given.numel(), 'value')}); {fix}"
        )


def require_usable_scales(plan: WeightPlan, tensors: Mapping[str, Tensor], padded: Tensor, given: GivenScales) -> None:
    """QuantizeError when a scale written for the (zero-padded) weight cannot dequantize it: a weight
    scale or global scale that is not finite and > 0, or a largest element that dequantizes to inf.
    ``given`` says which scales the caller gave (already checked as given), for the message.

    One min/max pass over the stored scales decides; the elementwise search for the first bad
    scale only runs to word the error.
    """
    spec = plan.scheme.weight
    name = spec.scale.tensor.name
    stored = tensors[name].reshape(plan.layout.scale_shape)
    low, high = _extremes(stored)
    if not (low > 0 and math.isfinite(high)):
        bad = not_positive(stored)
        position, shown, count = _first_bad(stored, bad)
        origin = "given" if given.scale is not None else "computed"
        raise QuantizeError(
            f"scheme {plan.scheme.name}: the {name} {origin} for {_region(plan, padded, *position)} is {shown}"
            f"{_in(stored.dtype)}, not a finite scale > 0 "
            f"({count_text(count, stored.numel(), 'scale')}); {_overflow_fix(plan)}"
        )
    largest_multiplier = 1 / low if spec.scale.stored == "reciprocal" else high  # Python floats: no overflow
    global_value, divides = None, False
    if spec.global_scale is not None:
        global_name = spec.global_scale.tensor.name
        global_scale = tensors[global_name]
        if bool(not_positive(global_scale).any()):
            absmax = float(padded.abs().amax().to(torch.float32))
            raise QuantizeError(
                f"scheme {plan.scheme.name}: the {global_name} computed from the weight's absmax {absmax:g} is "
                f"{_shown(global_scale.reshape(-1)[0])}{_in(global_scale.dtype)}, not a finite scale > 0; "
                f"{_overflow_fix(plan)}"
            )
        global_value = global_scale.to(torch.float32).reshape(())
        divides = spec.global_scale.stored == "reciprocal"
        factor = float(global_value)
        largest_multiplier = largest_multiplier / factor if divides else largest_multiplier * factor
    largest = largest_element(plan.scheme)
    if largest_multiplier * largest < FLOAT32_MAX / 2:
        return  # far from float32's limit: the float32 arithmetic below cannot overflow either
    multiplier = _multipliers(plan, stored)
    if global_value is not None:
        multiplier = multiplier / global_value if divides else multiplier * global_value
    overflows = dequantizes_to_nonfinite(multiplier, largest)
    if bool(overflows.any()):
        position, shown, count = _first_bad(multiplier, overflows)
        raise QuantizeError(
            f"scheme {plan.scheme.name}: the {name} of {_region(plan, padded, *position)} dequantizes its largest "
            f"element, {largest:g} x {shown}, to infinity in float32 ({count_text(count, stored.numel(), 'scale')}); "
            f"{_dequantize_overflow_fix(plan, given)}"
        )


# --- helpers --------------------------------------------------------------------------------


def _extremes(stored: Tensor) -> tuple[float, float]:
    """(smallest, largest) value of a stored scale, NaN when it holds a NaN (e8m0 0xFF included)."""
    if stored.dtype == torch.uint8:  # e8m0 bytes: the value grows with the byte
        low, high = torch.aminmax(stored)
        if int(high) == E8M0_NAN:
            return math.nan, math.nan
        return 2.0 ** (int(low) - 127), 2.0 ** (int(high) - 127)
    elif stored.dtype == torch.float8_e4m3fn:  # positive values grow with the byte; NaN is 0x7F, < 0 is >= 0x80
        low, high = torch.aminmax(stored.view(torch.int8))
        if int(low) < 0 or int(high) == 0x7F:
            return math.nan, math.nan
        values = torch.stack([low, high]).view(torch.float8_e4m3fn).to(torch.float32)
    else:
        low, high = torch.aminmax(stored if stored.dtype in AMINMAX_DTYPES else stored.to(torch.float32))
        values = torch.stack([low, high]).to(torch.float64)
    return float(values[0]), float(values[1])


def _multipliers(plan: WeightPlan, stored: Tensor) -> Tensor:
    """The float32 dequant multipliers of a written weight scale, global scale not folded in."""
    if stored.dtype == torch.uint8:
        return decode(stored, "e8m0")
    value = stored.to(torch.float32)
    return torch.reciprocal(value) if plan.scheme.weight.scale.stored == "reciprocal" else value


def _region(plan: WeightPlan, padded: Tensor, row: int, column: int) -> str:
    """Which weight elements scale [row, column] covers, with their absmax (or min and max)."""
    layout: ScaleLayout = plan.layout
    values = padded
    if layout.granularity != "tensor":
        first_row, first_column = row * layout.tile_rows, column * layout.tile_columns
        rows = slice(first_row, min(first_row + layout.tile_rows, plan.n))
        columns = slice(first_column, min(first_column + layout.tile_columns, plan.k))
        values = padded[rows, columns]
    values = values.to(torch.float32)
    if plan.has_zero_point:
        statistics = f"min {float(values.min()):g}, max {float(values.max()):g}"
    else:
        statistics = f"absmax {float(values.abs().max()):g}"
    if layout.granularity == "tensor":
        return f"the whole weight ({statistics})"
    if layout.granularity == "channel":
        return f"row {row} ({statistics})"
    spans = f"columns {columns.start}-{columns.stop - 1}, {statistics}"
    if layout.granularity == "group":
        return f"row {row}, group {column} ({spans})"
    return f"block [{row}, {column}] (rows {rows.start}-{rows.stop - 1}, {spans})"


def _overflow_fix(plan: WeightPlan) -> str:
    if plan.dtype != torch.float32:
        return (
            f"the weight is {_dtype_name(plan.dtype)}, and scales computed in its dtype overflow: quantize "
            "weight.float(), or use a scheme with a global scale"
        )
    return "scale the weight down, or use a scheme with a global scale"


def _dequantize_overflow_fix(plan: WeightPlan, given: GivenScales) -> str:
    spec = plan.scheme.weight
    names = [spec.scale.tensor.name] if given.scale is not None else []
    if given.global_scale is not None and spec.global_scale is not None:
        names.append(spec.global_scale.tensor.name)
    if names:
        them = "them" if len(names) > 1 else "it"
        return (
            f"check the given {' and '.join(names)}: give the scales a checkpoint of the scheme stores, "
            f"or leave {them} out to have {them} computed"
        )
    return "the weight's values are too close to the float32 maximum: scale the weight down"


def _first_bad(value: Tensor, bad: Tensor) -> tuple[tuple[int, ...], str, int]:
    """(position of the first True of ``bad`` in ``value``, that value as text, how many are True)."""
    first, count = first_true(bad)
    return first, _shown(value[first] if first else value.reshape(())), count


def _shown(element: Tensor) -> str:
    if element.dtype == torch.uint8:
        byte = int(element)
        return "byte 0xFF (NaN)" if byte == E8M0_NAN else f"byte 0x{byte:02X}"
    return f"{float(element if element.dtype == torch.float64 else element.to(torch.float32)):g}"


def _in(dtype: torch.dtype) -> str:
    return "" if dtype == torch.uint8 else f" in {_dtype_name(dtype)}"


def _at(position: tuple[int, ...]) -> str:
    return f" at {list(position)}" if position else ""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
