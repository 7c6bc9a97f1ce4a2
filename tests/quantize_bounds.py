"""Round-trip error bounds for quantize_weight -> dequantize_weight tests."""

from __future__ import annotations

import torch
from torch import Tensor

from qscheme.canonical import canonicalize, effective_scale
from qscheme.catalog import load_catalog, load_scheme
from qscheme.dequantize import dequantize_weight
from qscheme.descriptor import Scheme
from qscheme.formats import representable_values


def builtin_element_schemes() -> list[str]:
    """The built-in schemes qscheme's own quantizer writes (blocks: llama.cpp's quantizers, tested
    against llama.cpp), by name."""
    return sorted(
        scheme.name
        for scheme in load_catalog(include_plugins=False)
        if scheme.source == "builtin" and scheme.weight.blocks is None
    )


def _per_element(value: Tensor, tile: tuple[int, int], n: int, k: int) -> Tensor:
    rows, columns = tile
    return value.repeat_interleave(rows, dim=0)[:n].repeat_interleave(columns, dim=1)[:, :k]


def assert_within_half_a_step(scheme: str | Scheme, weight: Tensor, tensors: dict[str, Tensor]) -> None:
    """|dequantized - weight| <= half the gap between the two representable values around each
    scaled element (or its distance beyond the largest one), in weight units.

    Producers divide a bf16 or fp16 weight by its scale in that dtype (and add a zero point in
    it) before rounding to the element format, so the scaled value may already be off by half an
    ulp of the weight's dtype per operation: that much is allowed on top (2**-24 relative for
    float32 weights).
    """
    scheme = load_scheme(scheme)
    canonical = canonicalize(scheme, tensors)
    n, k = canonical.n, canonical.k
    spec = scheme.weight.scale
    tile = {"group": (1, spec.group_size or 1), "block": spec.block or (1, 1)}.get(spec.granularity, (n, k))
    scale = effective_scale(canonical)
    if spec.granularity in ("tensor", "channel"):
        tile = (1, k)
        scale = scale.reshape(-1, 1).expand(n, 1)
    scale = _per_element(scale, tile, n, k).double()
    zero: Tensor | float = 0.0
    if canonical.zero_point is not None:
        zero = _per_element(canonical.zero_point.double(), tile, n, k)
    # A zero scale (an all-zero block, as bitsandbytes stores it) allows no error at all.
    unshifted = weight.double() / torch.where(scale == 0, 1.0, scale)
    scaled = unshifted + zero
    grid = representable_values(scheme.weight.format).double()
    upper = torch.searchsorted(grid, scaled).clamp(1, len(grid) - 1)
    half_gap = (grid[upper] - grid[upper - 1]) / 2
    beyond = (scaled - scaled.clamp(float(grid[0]), float(grid[-1]))).abs()
    intermediate = (unshifted.abs() + scaled.abs()) * torch.finfo(weight.dtype).eps / 2 + 2.0**-40
    allowed = (torch.maximum(half_gap, beyond) + intermediate) * scale * (1 + 2.0**-20)
    error = (dequantize_weight(tensors, scheme).double() - weight.double()).abs()
    worst = int((error - allowed).argmax())
    assert bool((error <= allowed).all()), (
        f"{scheme.name}: error {float(error.flatten()[worst])} > {float(allowed.flatten()[worst])} "
        f"at element {divmod(worst, k)} (weight {float(weight.flatten()[worst])})"
    )
