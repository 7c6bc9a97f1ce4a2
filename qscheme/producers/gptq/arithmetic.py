"""The ``gptq`` rule set: round-to-nearest min/max quantization (compressed-tensors' arithmetic,
which GPTQ's own RTN quantizer shares: scale ``(max - min) / range`` or ``absmax / half range``,
zero point ``-min / scale`` rounded), with the zero points kept where the scheme's stored form
holds them: GPTQ's v1 format stores ``zero - 1`` (``zero_point.offset: -1``), so an unsigned
zero of 0 has no stored value; such groups take the smallest zero the file can hold (1), which
clips their smallest weights by at most one step instead of writing a word other readers read
differently (GPTQModel borrows from the neighbouring zero point, AutoGPTQ's kernels do not)."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from qscheme.canonical import zero_point_range
from qscheme.producers.compressed_tensors.arithmetic import CompressedTensorsRules
from qscheme.quantize.rules import GivenScales, WeightParameters, WeightPlan, register_rules


class GptqRules(CompressedTensorsRules):
    """The ``gptq`` rule set."""

    name = "gptq"

    def parameters(self, plan: WeightPlan, padded: Tensor, given: GivenScales) -> WeightParameters:
        parameters = super().parameters(plan, padded, given)
        spec = plan.scheme.weight.zero_point
        if spec is None or not spec.offset or parameters.zero_point is None:
            return parameters
        low, high = zero_point_range(spec)
        clamped = torch.clamp(parameters.zero_point, low, high)
        return dataclasses.replace(parameters, zero_point=clamped)


register_rules(GptqRules())
