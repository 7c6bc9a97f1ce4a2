"""dequantize_weight: checkpoint tensors of one layer -> its float32 [N, K] weight."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from qscheme.canonical import canonicalize, dequantize
from qscheme.catalog import load_scheme
from qscheme.descriptor import Scheme
from qscheme.errors import QuantizeError


def dequantize_weight(tensors: Mapping[str, Tensor], scheme: Scheme | str | Path) -> Tensor:
    """The float32 [N, K] weight held by one layer's checkpoint tensors (keyed by checkpoint name).

    Equal to ``canonical.dequantize(canonical.canonicalize(scheme, tensors))``: bit-identical to
    the producer's own float32 dequantization, except that e2m1's negative zero (code 0x8)
    decodes to +0.0.
    """
    scheme = load_scheme(scheme)
    weight = scheme.weight
    required = [weight.tensor, weight.scale.tensor]
    if weight.global_scale is not None:
        required.append(weight.global_scale.tensor)
    if weight.zero_point is not None:
        required.append(weight.zero_point.tensor)
    missing = [spec.name for spec in required if spec.name not in tensors]
    if missing:
        raise QuantizeError(
            f"scheme {scheme.name}: missing tensor(s) {', '.join(repr(name) for name in missing)}; "
            f"got {', '.join(repr(name) for name in tensors) or 'none'}"
        )
    with torch.no_grad():
        return dequantize(canonicalize(scheme, tensors))
