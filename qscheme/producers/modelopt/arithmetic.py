"""NVIDIA ModelOpt's export arithmetic (0.47: ``modelopt.torch.quantization.qtensor`` and
``modelopt.torch.export.quant_utils``), mirrored operation for operation.

Every ModelOpt scale is a float32 dequant multiplier computed from amax = max|w| of its region
(taken in the weight's dtype, then widened to float32):

- e4m3 block scales under a per-tensor ``weight_scale_2`` (NVFP4): ``weight_scale_2 =
  amax / (element max * 448)`` (amax / 2688), or ``amax / 448`` when the layer's activations are
  FP8 (W4A8_NVFP4_FP8: the kernel dequantizes the weight to FP8, so element x block scale must
  fit in 448); block scale ``amax_block / (element max * weight_scale_2)``, zeros set to 1, clamped
  to [2**-9, 448] and cast to e4m3; elements ``w / (e4m3 block scale * weight_scale_2)``, rounded
  half to even;
- e8m0 block scales (MXFP4): exponent ``ceil(max(log2(amax / element max), -127))``; elements
  ``w / 2**exponent`` rounded with ties toward zero and the sign bit set for every value not above
  zero (``MXFP4QTensor``'s cast);
- float scales: ``amax / element max`` (FP8 amax / 448, INT4 AWQ amax / 7), amax clamped to the
  smallest normal float32 as ``export_amax`` does; a per-tensor scale is the 0-dim
  ``torch.tensor(amax / 448)`` of the FP8 exporter, so a bf16 weight is divided in bf16 before the
  cast to e4m3, while block and channel scales divide in float32.

ModelOpt writes a second-level scale (``weight_scale_2``, a multiplier) only with e4m3 block
scales. A descriptor may declare one with other scale formats; its value must then be given
(ModelOpt has no rule to compute it), and every scale is computed relative to it exactly as
NVFP4's block scales are: the scale of ``amax / multiplier`` (e8m0: the exponent of
``amax / (element max * multiplier)``; float: ``amax / (element max * multiplier)`` rounded to
the stored dtype; min/max scales of zero points likewise), elements divided by scale x
multiplier. So the written tensors dequantize to the weight whatever multiplier is given.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qscheme.errors import QuantizeError
from qscheme.formats import decode, get_element_format
from qscheme.formats.table import FORMAT_FACTS, is_float_scale
from qscheme.quantize.observe import observe_absmax, observe_min_max
from qscheme.quantize.rules import (
    GivenScales,
    WeightParameters,
    WeightPlan,
    divide_then_add_zero_point,
    register_rules,
    require_finite,
)

_E4M3_MAX = FORMAT_FACTS["e4m3"].max_value
_E4M3_SMALLEST_SUBNORMAL = FORMAT_FACTS["e4m3"].smallest_positive


def _is_eight_bit_float(name: str) -> bool:
    facts = FORMAT_FACTS.get(name)
    return facts is not None and facts.kind == "float" and facts.bits == 8


class ModeloptRules:
    """The ``modelopt`` rule set."""

    name = "modelopt"

    def preferred_float_scale_dtype(self, weight_dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    def parameters(self, plan: WeightPlan, padded: Tensor, given: GivenScales) -> WeightParameters:
        element = plan.element
        absmax = observe_absmax(padded, plan.layout)
        require_finite(absmax, absmax, plan)
        amax = absmax.float()
        multiplier = self._global_multiplier(plan, amax, given) if plan.has_global_scale else None
        zero_point = None

        if given.scale is not None:
            stored = given.scale
            division = self._multiplier_from_stored(plan, stored, multiplier)
        elif plan.has_zero_point:
            stored, division, zero_point = self._asymmetric(
                plan, *observe_min_max(padded, plan.layout), multiplier=multiplier
            )
        elif plan.scale_format == "e4m3":
            block = amax / (element.max_value * multiplier) if multiplier is not None else amax / element.max_value
            block[block == 0] = 1.0
            stored = block.clamp(min=_E4M3_SMALLEST_SUBNORMAL, max=_E4M3_MAX).to(torch.float8_e4m3fn)
            division = self._multiplier_from_stored(plan, stored, multiplier)
        elif plan.scale_format == "e8m0":
            lowest = torch.tensor(-127.0, device=amax.device)
            ratio = amax / element.max_value if multiplier is None else amax / (element.max_value * multiplier)
            # 128 (byte 0xFF, NaN) at most: require_usable_scales then names the group
            exponent = torch.ceil(torch.maximum(torch.log2(ratio), lowest)).clamp(max=128.0)
            stored = (exponent + 127).to(torch.uint8)
            division = torch.exp2(exponent) if multiplier is None else torch.exp2(exponent) * multiplier
        elif plan.layout.granularity == "tensor":
            # the FP8 exporter: torch.tensor(amax.item() / maxbound), a 0-dim float32 tensor
            value = max(float(amax.reshape(())), torch.finfo(torch.float32).tiny) / element.max_value
            scale = torch.tensor(value, dtype=torch.float32, device=padded.device)
            if multiplier is not None:
                scale = scale / multiplier.reshape(())
            stored = scale.to(plan.float_scale_dtype)
            division = self._multiplier_from_stored(plan, stored, multiplier)
        else:
            scale = amax.clamp(min=torch.finfo(torch.float32).tiny) / element.max_value
            if multiplier is not None:
                scale = scale / multiplier
            stored = scale.to(plan.float_scale_dtype)
            division = self._multiplier_from_stored(plan, stored, multiplier)

        if plan.element.name == "e2m1" and plan.scale_format == "e8m0":
            ties, sign_of_zero = "down", "not-positive"
        elif plan.element.name == "e2m1":
            ties, sign_of_zero = "even", "negative-below-zero"
        else:
            ties, sign_of_zero = "even", "keep"
        return WeightParameters(
            stored_scale=stored,
            division_scale=division,
            scale_elements=divide_then_add_zero_point,
            ties=ties,
            sign_of_zero=sign_of_zero,
            global_scale=None if multiplier is None else multiplier.reshape(1),
            global_convention=None if multiplier is None else "multiplier",
            zero_point=zero_point,
        )

    def _global_multiplier(self, plan: WeightPlan, amax: Tensor, given: GivenScales) -> Tensor:
        if given.global_scale is not None:
            value = given.global_scale.reshape(()).to(torch.float32)
            stored = plan.scheme.weight.global_scale.stored if plan.scheme.weight.global_scale else "multiplier"
            return value if stored == "multiplier" else torch.reciprocal(value)
        if plan.scale_format != "e4m3":
            raise QuantizeError(
                f"scheme {plan.scheme.name}: ModelOpt computes a second-level scale only for e4m3 block "
                f"scales, not {plan.scale_format!r}; give the global scale, or use scale format e4m3"
            )
        denominator = plan.element.max_value * _E4M3_MAX
        if plan.activation_format is not None and _is_eight_bit_float(plan.activation_format):
            # FP8 activations: the kernel dequantizes the weight to FP8, so the largest element
            # times the largest block scale must fit the activation format (W4A8_NVFP4_FP8).
            denominator = min(denominator, get_element_format(plan.activation_format).max_value)
        global_amax = amax.amax().clamp(min=torch.finfo(torch.float32).tiny)
        return global_amax / denominator

    def _multiplier_from_stored(self, plan: WeightPlan, stored: Tensor, multiplier: Tensor | None) -> Tensor:
        if plan.scale_format == "e8m0":
            value = decode(stored, "e8m0")
        else:
            value = stored.to(torch.float32)
        if plan.layout.granularity == "tensor" and is_float_scale(plan.scale_format):
            value = value.reshape(())
        return value if multiplier is None else value * multiplier

    def _asymmetric(
        self, plan: WeightPlan, minimum: Tensor, maximum: Tensor, multiplier: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Min/max scales and zero points in float32 (ModelOpt exports none; a generic extension).

        Under a global multiplier the stored scales are relative to it, as NVFP4's block scales are.
        """
        if not is_float_scale(plan.scale_format):
            raise QuantizeError(
                f"scheme {plan.scheme.name}: zero points need a float scale format, not {plan.scale_format!r}"
            )
        element = plan.element
        zeros = torch.zeros_like(minimum)
        low, high = torch.min(minimum, zeros).float(), torch.max(maximum, zeros).float()
        scale = (high - low) / (element.max_value - element.min_value)
        scale = torch.where(scale == 0, torch.finfo(torch.float32).tiny, scale)
        if multiplier is not None:
            scale = scale / multiplier
        stored = scale.to(plan.float_scale_dtype)
        division = stored.to(torch.float32)
        if multiplier is not None:
            division = division * multiplier
        zero_point = torch.round(torch.clamp(element.min_value - low / division, element.min_value, element.max_value))
        return stored, division, zero_point.to(torch.int16)


register_rules(ModeloptRules())
