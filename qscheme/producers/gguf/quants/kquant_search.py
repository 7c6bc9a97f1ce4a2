"""The scale searches of ggml's k-quants: ``make_qkx2_quants``, ``make_qx_quants``, ``make_q3_quants``.

Each works on many sub-blocks at once: ``x`` is float32 ``[n, lanes]``, one sub-block of n weights
per column (element-major, so C's ``for (i = 0; i < n; ++i) sum += ...`` is a loop over rows
adding whole vectors, see c_float). Each returns integer levels ``[n, lanes]`` (int32) and one
scale per lane, computed in C's order of float32 operations, so that the search takes the same
branch as C in every lane; the branches themselves become ``torch.where``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from qscheme.producers.gguf.quants.c_float import (
    divide,
    first_of_largest_magnitude,
    nearest_int,
    nearest_level,
    sequential_sum,
)

# ggml-quants.c's GROUP_MAX_EPS: a group whose largest magnitude is below it is all zero.
GROUP_MAX_EPS = float(np.float32(1e-15))


def _levels(scaled: Tensor, low: int, high: int) -> Tensor:
    """``MAX(low, MIN(high, nearest_int(scaled)))`` (int32), for any float argument."""
    return torch.clamp(nearest_int(scaled), low, high)


def make_qkx2_quants(
    x: Tensor, weights: Tensor, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric levels 0..nmax with a scale and a min, by a weighted least-squares search.

    Returns (levels int32, scale, the_min) where a weight is ``scale * level - the_min``: C's
    return value and its ``*the_min``. The search tries ``nstep + 1`` inverse scales
    ``(rmin + rdelta * is + nmax) / (max - min)`` (with the best min so far) and keeps each fit
    whose weighted error (absolute with ``use_mad``, else squared) is strictly smaller.
    Levels are rounded with ``nearest_level``: every argument lies in [0, nmax + rmin + rdelta nstep].
    """
    low = x.amin(dim=0)
    high = x.amax(dim=0)
    low = torch.where(low > 0, torch.zeros_like(low), low)
    flat = high == low
    flat_min = -low
    sum_w = sequential_sum(weights, start_from_zero=False)
    sum_x = sequential_sum(weights * x, start_from_zero=False)

    inverse = divide(float(nmax), high - low)
    scale = divide(1.0, inverse)
    levels = nearest_level((x - low) * inverse, 0, nmax)
    best_error = _weighted_error(x, weights, levels, scale, low, use_mad)

    products = torch.empty((x.shape[0], 3, x.shape[1]), dtype=x.dtype, device=x.device)
    float_nmax = np.float32(nmax)
    for step in range(nstep + 1):
        numerator = float((np.float32(rmin) + np.float32(rdelta) * np.float32(step)) + float_nmax)
        candidate = nearest_level((x - low) * divide(numerator, high - low), 0, nmax)
        weighted = torch.mul(weights, candidate, out=products[:, 0])
        torch.mul(weighted, candidate, out=products[:, 1])
        torch.mul(weighted, x, out=products[:, 2])
        sum_l, sum_l2, sum_xl = sequential_sum(products).unbind(0)
        determinant = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / determinant
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / determinant
        positive_min = this_min > 0
        this_min = torch.where(positive_min, torch.zeros_like(this_min), this_min)
        this_scale = torch.where(positive_min, sum_xl / sum_l2, this_scale)
        error = _weighted_error(x, weights, candidate, this_scale, this_min, use_mad)
        better = (determinant > 0) & (error < best_error)
        levels = torch.where(better, candidate, levels)
        best_error = torch.where(better, error, best_error)
        scale = torch.where(better, this_scale, scale)
        low = torch.where(better, this_min, low)

    levels = torch.where(flat, torch.zeros_like(levels), levels).to(torch.int32)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    return levels, scale, torch.where(flat, flat_min, -low)


def _weighted_error(x: Tensor, weights: Tensor, levels: Tensor, scale: Tensor, low: Tensor, use_mad: bool) -> Tensor:
    """``sum += w * diff`` with ``diff = scale * l + min - x``, absolute or squared."""
    difference = levels * scale
    difference += low
    difference -= x
    if use_mad:
        difference.abs_()
    else:
        difference.mul_(difference)
    difference.mul_(weights)
    return sequential_sum(difference)


def make_qx_quants_rmse(x: Tensor, nmax: int) -> tuple[Tensor, Tensor]:
    """Symmetric levels -nmax..nmax-1 (returned shifted by nmax), weights x², no importance.

    C's ``make_qx_quants(n, nmax, x, L, 1, NULL)``: round with ``-nmax / max``, then try the 18
    inverse scales ``-(nmax + 0.1 is) / max`` (is = -9..9, not 0) and keep any whose
    least-squares fit is strictly better. Returns (levels + nmax as int32, scale); an all-zero
    group gets levels 0 and scale 0. Every rounded argument is at most nmax + 1 in magnitude.
    """
    amax, signed_max = first_of_largest_magnitude(x)
    zero = amax < GROUP_MAX_EPS
    squared = x * x
    weighted_x = squared * x
    products = torch.empty((x.shape[0], 2, x.shape[1]), dtype=x.dtype, device=x.device)

    def fit(inverse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        candidate = nearest_level(x * inverse, -nmax, nmax - 1)
        torch.mul(weighted_x, candidate, out=products[:, 0])
        torch.mul(torch.mul(squared, candidate, out=products[:, 1]), candidate, out=products[:, 1])
        sum_lx, sum_l2 = sequential_sum(products).unbind(0)
        return candidate, sum_lx, sum_l2

    levels, sum_lx, sum_l2 = fit(divide(float(-nmax), signed_max))
    scale = torch.where(sum_l2 != 0, sum_lx / sum_l2, torch.zeros_like(sum_l2))
    best = scale * sum_lx
    for step in range(-9, 10):
        if step == 0:
            continue
        numerator = -float(np.float32(nmax) + np.float32(0.1) * np.float32(step))
        candidate, sum_lx, sum_l2 = fit(divide(numerator, signed_max))
        better = (sum_l2 > 0) & (sum_lx * sum_lx > best * sum_l2)
        levels = torch.where(better, candidate, levels)
        scale = torch.where(better, sum_lx / sum_l2, scale)
        best = torch.where(better, scale * sum_lx, best)

    levels = torch.where(zero, torch.zeros_like(levels), levels + nmax).to(torch.int32)
    return levels, torch.where(zero, torch.zeros_like(scale), scale)


def make_q3_quants(x: Tensor, nmax: int) -> tuple[Tensor, Tensor]:
    """Symmetric levels -nmax..nmax-1 (returned shifted by nmax), refined one weight at a time.

    C's ``make_q3_quants(n, nmax, x, L, true)``: round with ``-nmax / max``, then up to 5 passes
    over the weights in order, each moving one weight's level to its best value given the others
    when that strictly improves the weighted (x²) fit. A pass that changes nothing ends C's loop;
    here such a lane just goes on unchanged (a pass over an unchanged state changes nothing).
    Returns (levels + nmax, scale); an all-zero group gets levels 0 (not nmax) and scale 0.
    """
    amax, signed_max = first_of_largest_magnitude(x)
    zero = amax < GROUP_MAX_EPS
    levels = _levels(divide(float(-nmax), signed_max) * x, -nmax, nmax - 1)
    squared = x * x
    weighted_x = squared * x
    as_float = levels.to(torch.float32)
    sum_lx, sum_l2 = sequential_sum(torch.stack([weighted_x * as_float, squared * as_float * as_float], dim=1)).unbind(
        0
    )

    for _ in range(5):
        changed_any = torch.zeros_like(zero)
        for i in range(x.shape[0]):
            weight_x, weight = weighted_x[i], squared[i]
            current = levels[i].to(torch.float32)
            rest_lx = sum_lx - weight_x * current
            rest_l2 = sum_l2 - weight * current * current
            proposal = _levels((x[i] * rest_l2) / rest_lx, -nmax, nmax - 1)
            as_float = proposal.to(torch.float32)
            new_lx = rest_lx + weight_x * as_float
            new_l2 = rest_l2 + weight * as_float * as_float
            accept = (
                (rest_lx > 0)
                & (proposal != levels[i])
                & (new_l2 > 0)
                & (new_lx * new_lx * sum_l2 > sum_lx * sum_lx * new_l2)
            )
            levels[i] = torch.where(accept, proposal, levels[i])
            sum_lx = torch.where(accept, new_lx, sum_lx)
            sum_l2 = torch.where(accept, new_l2, sum_l2)
            changed_any |= accept
        if not bool(changed_any.any()):
            break

    scale = torch.where(sum_l2 > 0, sum_lx / sum_l2, torch.zeros_like(sum_l2))
    levels = torch.where(zero, torch.zeros_like(levels), levels + nmax)
    return levels, torch.where(zero, torch.zeros_like(scale), scale)
