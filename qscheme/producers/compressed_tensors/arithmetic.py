"""compressed-tensors' quantization arithmetic, mirrored operation for operation.

The weight path of compressed-tensors 0.20 (with llm-compressor's min/max observer) is:

1. observe: min and max of every scale region, in the weight's dtype;
2. ``generate_gparam`` (NVFP4's global scale, a divisor): ``448 * 6 / max|w|`` computed in the
   weight's dtype (a bf16 weight gives a bf16-rounded value), NaN/inf replaced by 1, then float32;
3. ``calculate_qparams``: widen [min, max] to include 0; symmetric scale ``max|w| / (range / 2)``
   (``absmax / 7.5`` for int4, ``/ 127.5`` int8, ``/ 448`` e4m3, ``/ 6`` e2m1) or MX exponents,
   asymmetric scale ``(max - min) / range`` and zero point ``qmin - min / scale``, all in the
   weight's dtype; times the global scale (float32 from here on); rounded to e4m3 if the scale
   is e4m3; zeros replaced by eps (0.125 for e4m3, 1 for e8m0, else the dtype's eps); zero
   point clamped, rounded and cast to int8;
4. the module's scale parameter has the weight's dtype (float32 for the global scale), so scales
   are stored in it (exact for e4m3 values);
5. ``quantize``: ``x / (scale / global_scale)`` (float32 when there is a global scale, else the
   weight's dtype), plus the zero point where the module has one (every non-FP4 scheme: zeros when
   symmetric, which only turns -0.0 into +0.0), clamped and rounded to the element format;
6. the compressor casts scales to e4m3 / e8m0 bytes and packs the elements.

Kept from the producer although lossy (it is what compressed-tensors 0.20.1 writes for the same
weight, bit for bit): for a float16 weight whose absmax is below 2688 / 65504 (about 0.041),
``448 * 6 / absmax`` overflows float16 and the global scale becomes 1.0; the e4m3 block scales
``absmax_block / 6`` then lose precision or underflow (zeros become 0.125). Quantize
``weight.float()`` to get compressed-tensors' float32 result (a global scale of ``2688 /
absmax``), or give ``weight_global_scale``.

A global scale with e8m0 (MX) scales is refused unless the e8m0 scales are given too:
``calculate_qparams`` multiplies the MX exponent bytes by the global scale, so compressed-tensors
has no rule that gives a usable checkpoint.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qscheme.errors import FormatError, QuantizeError
from qscheme.formats import decode, get_element_format, mx_scale_exponent
from qscheme.formats.table import FORMAT_FACTS, float_scale_formats
from qscheme.quantize.observe import observe_absmax, observe_min_max
from qscheme.quantize.rules import (
    GivenScales,
    WeightParameters,
    WeightPlan,
    divide_then_add_zero_point,
    register_rules,
    replace_zero_scales,
    require_finite,
)

_E4M3_MAX = FORMAT_FACTS["e4m3"].max_value
_FLOAT_FORMAT_DTYPES = {name: get_element_format(name).storage_dtype for name in float_scale_formats()}


class CompressedTensorsRules:
    """The ``compressed-tensors`` rule set."""

    name = "compressed-tensors"

    def preferred_float_scale_dtype(self, weight_dtype: torch.dtype) -> torch.dtype:
        # initialize_qparams gives scale parameters the observed (weight) dtype
        return weight_dtype if weight_dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.float16

    def parameters(self, plan: WeightPlan, padded: Tensor, given: GivenScales) -> WeightParameters:
        dtype = padded.dtype
        element = plan.element
        # calculate_range's limits are 0-dim tensors on the weight's device (on CUDA, dividing by
        # one is a true division, unlike dividing by a Python number or a CPU scalar)
        q_min = torch.tensor(element.min_value, device=padded.device)
        q_max = torch.tensor(element.max_value, device=padded.device)
        if plan.has_zero_point:
            minimum, maximum = observe_min_max(padded, plan.layout)
            require_finite(minimum, maximum, plan)
            zeros = torch.zeros_like(minimum)
            min_vals, max_vals = torch.min(minimum, zeros), torch.max(maximum, zeros)
            absmax = torch.max(torch.abs(min_vals), torch.abs(max_vals))
        else:
            # calculate_qparams' symmetric path only uses max(|min(min, 0)|, |max(max, 0)|)
            absmax = observe_absmax(padded, plan.layout)
            require_finite(absmax, absmax, plan)

        if plan.has_global_scale and plan.scale_format == "e8m0" and given.scale is None:
            # calculate_qparams multiplies the MX exponent bytes by the global scale
            # (global_scale * generate_mx_scales(...)), so no checkpoint it writes dequantizes
            raise QuantizeError(
                f"scheme {plan.scheme.name}: compressed-tensors has no rule for e8m0 (MX) scales under a "
                "global scale (it multiplies the exponent bytes by the global scale); remove global_scale, "
                "use e4m3 or float scales, or give the e8m0 weight_scale as well"
            )
        divisor = self._global_divisor(plan, absmax, given) if plan.has_global_scale else None
        zero_point = None
        if given.scale is not None:
            stored = given.scale
            parameter = self._parameter_from_stored(plan, stored, dtype)
        else:
            if plan.has_zero_point:
                if plan.scale_format == "e8m0":
                    raise QuantizeError(
                        f"scheme {plan.scheme.name}: e8m0 (power of two) scales have no zero points; "
                        "remove zero_point or use a float scale format"
                    )
                scales, zero_float = self._asymmetric(min_vals, max_vals, q_min, q_max, dtype)
            else:
                scales = self._symmetric(plan, absmax, q_max - q_min)
                zero_float = None
            if plan.scale_format == "e8m0":
                stored = scales  # already the stored bytes
                parameter = decode(stored, "e8m0").to(dtype)
            else:
                if divisor is not None:
                    scales = divisor * scales
                scales = self._round_scales(plan, scales)
                parameter, stored = self._store(plan, scales, dtype)
            if zero_float is not None:
                zero_point = self._round_zero_point(zero_float, q_min, q_max)

        division = parameter if divisor is None else parameter / divisor
        if plan.layout.granularity == "tensor":
            division = division.reshape(1)  # a [1] parameter, as compressed-tensors registers it
        fp4 = element.name == "e2m1"
        return WeightParameters(
            stored_scale=stored,
            division_scale=division,
            scale_elements=divide_then_add_zero_point,
            ties="even",
            # FP4 compressors pass no zero point; every other one adds the module's zero point,
            # zeros when symmetric, which turns -0.0 into +0.0 before the cast.
            sign_of_zero="negative-below-zero" if fp4 else "positive",
            global_scale=divisor,
            global_convention="reciprocal" if divisor is not None else None,
            zero_point=zero_point,
        )

    # --- steps ------------------------------------------------------------------------------

    def _global_divisor(self, plan: WeightPlan, absmax: Tensor, given: GivenScales) -> Tensor:
        if given.global_scale is not None:
            value = given.global_scale.reshape(1).to(torch.float32)
            stored = plan.scheme.weight.global_scale.stored if plan.scheme.weight.global_scale else "reciprocal"
            return value if stored == "reciprocal" else torch.reciprocal(value)
        if plan.scale_format != "e4m3":
            raise QuantizeError(
                f"scheme {plan.scheme.name}: compressed-tensors computes a global scale only for e4m3 "
                f"block scales, not {plan.scale_format!r}; give the global scale, or use scale format e4m3"
            )
        # generate_gparam on the observer's whole-tensor min and max, in the weight's dtype:
        # max(|min(min, 0)|, |max(max, 0)|) is the largest region absmax
        largest = torch.clamp(absmax.amax().reshape(1), min=torch.finfo(absmax.dtype).tiny)
        divisor = (_E4M3_MAX * plan.element.max_value) / largest
        divisor = torch.nan_to_num(divisor, nan=1.0, posinf=1.0, neginf=1.0)
        return divisor.to(torch.float32).reshape(1)

    def _symmetric(self, plan: WeightPlan, absmax: Tensor, bit_range: Tensor) -> Tensor:
        element = plan.element
        if not element.signed:
            raise QuantizeError(
                f"scheme {plan.scheme.name}: unsigned element format {element.name!r} needs a zero point "
                "(zero_point: {format: ..., tensor: ...}); or use the signed format"
            )
        if plan.scale_format == "e8m0":
            try:
                return mx_scale_exponent(absmax, element)
            except FormatError as exc:
                raise QuantizeError(f"scheme {plan.scheme.name}: {exc}") from None
        # bit_range.to(dtype) / 2, exact for every format compressed-tensors has (15, 255, 896,
        # 12); e5m2's 114688 overflows float16, so its half range is taken in float32 first
        if element.name == "e5m2":
            half_range = (bit_range / 2).to(absmax.dtype)
        else:
            half_range = bit_range.to(absmax.dtype) / 2
        return absmax / half_range

    def _asymmetric(
        self, min_vals: Tensor, max_vals: Tensor, q_min: Tensor, q_max: Tensor, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        scales = (max_vals - min_vals) / (q_max - q_min).to(dtype)
        zero_point = q_min - (min_vals / scales)
        return scales, torch.clamp(zero_point, q_min, q_max)

    def _round_scales(self, plan: WeightPlan, scales: Tensor) -> Tensor:
        if plan.scale_format == "e4m3":
            scales = torch.clamp(scales, -_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn).to(scales.dtype)
            return replace_zero_scales(scales, 0.125)
        if plan.scale_format in _FLOAT_FORMAT_DTYPES:
            # round_to_quantized_type_dtype(scales, scale_dtype), with the clamp only where the
            # target is the narrower type (its limits may not fit the scales' own dtype)
            target = _FLOAT_FORMAT_DTYPES[plan.scale_format]
            info = torch.finfo(target)
            if info.max < torch.finfo(scales.dtype).max:
                scales = torch.clamp(scales, info.min, info.max)
            scales = scales.to(target).to(scales.dtype)
            return replace_zero_scales(scales, info.eps)
        return replace_zero_scales(scales, torch.finfo(scales.dtype).eps)

    def _store(self, plan: WeightPlan, scales: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(module parameter in the weight's dtype, stored scale)."""
        if plan.scale_format == "e4m3":
            parameter = scales.to(dtype)
            return parameter, parameter.to(torch.float8_e4m3fn)
        stored = scales.to(dtype).to(plan.float_scale_dtype)
        return stored.to(dtype), stored

    def _parameter_from_stored(self, plan: WeightPlan, stored: Tensor, dtype: torch.dtype) -> Tensor:
        if plan.scale_format == "e8m0":
            return decode(stored, "e8m0").to(dtype)
        return stored.to(dtype)

    def _round_zero_point(self, zero_point: Tensor, q_min: Tensor, q_max: Tensor) -> Tensor:
        # round_to_quantized_type_dtype(zp, int8): clamp, round half to even, cast. A NaN zero
        # point (a group of zeros: 0 / 0) casts to 0.
        rounded = torch.round(torch.clamp(zero_point, q_min, q_max))
        return torch.nan_to_num(rounded, nan=0.0).to(torch.int16)


register_rules(CompressedTensorsRules())
