"""dequantize_weight: checkpoint tensors of one layer -> its float32 [N, K] weight."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from qscheme.canonical import canonicalize, dequantize
from qscheme.catalog import load_scheme, require_scheme_argument
from qscheme.descriptor import Scheme
from qscheme.tensor_checks import require_valid_tensors


def dequantize_weight(tensors: Mapping[str, Tensor], scheme: Scheme | str | Path) -> Tensor:
    """The float32 [N, K] weight held by one layer's checkpoint tensors (keyed by checkpoint name).

    Equal to ``canonical.dequantize(canonical.canonicalize(scheme, tensors))``: bit-identical to
    the producer's own float32 dequantization, except that e2m1's negative zero (code 0x8)
    decodes to +0.0. The tensors get the checkpoint loader's checks (names, dtypes, shapes,
    scale values; see ``QuantLinear.from_tensors``): QuantizeError lists every problem. Keys that
    are not names, values that are not dense materialised tensors (sparse, meta, nested), and
    scales whose product would dequantize to inf, NaN or zero raise QuantizeError too; a scheme
    of another type than Scheme / str / path, UsageError.
    """
    require_scheme_argument(scheme, "dequantize_weight")
    scheme = load_scheme(scheme)
    n, k = require_valid_tensors(scheme, tensors, weight_only=True)
    with torch.no_grad():
        return dequantize(canonicalize(scheme, tensors, n, k))
