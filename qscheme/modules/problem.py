"""problem_for: the resolver's view of one canonical layer (shape, partitions, whether scales differ)."""

from __future__ import annotations

import torch
from torch import Tensor

from qscheme.canonical import CanonicalWeight
from qscheme.kernels.problem import Problem, normalize_dtype


def _differ(values: Tensor | None) -> bool:
    if values is None or values.numel() <= 1:
        return False
    flat = values.reshape(-1)
    return not bool(torch.all(flat == flat[0]))


def problem_for(
    weight: CanonicalWeight, activation_dtype: str | torch.dtype = "bfloat16", layer: str | None = None
) -> Problem:
    """The resolver's view of a canonical layer: shape, partitions and whether their scales differ."""
    scale_spec = weight.scheme.weight.scale
    per_tensor_scale = weight.scale if scale_spec.granularity == "tensor" else None
    differ = any(
        _differ(v) for v in (weight.global_scale, per_tensor_scale, weight.input_scale, weight.input_global_scale)
    )
    return Problem(
        n=weight.n,
        k=weight.k,
        activation_dtype=normalize_dtype(activation_dtype),
        partitions=max(1, len(weight.partitions)),
        partition_scales_differ=differ,
        input_pre_scale=weight.input_pre_scale is not None,
        layer=layer,
        input_permutation=weight.input_permutation is not None,
    )
