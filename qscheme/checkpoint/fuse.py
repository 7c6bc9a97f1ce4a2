"""Fuse several checkpoint modules (q/k/v, gate/up) into one CanonicalWeight, explicitly.

The partitions are concatenated along N. What happens to per-partition scalars that differ
(NVFP4 global scales, FP8 per-tensor scales, static input scales) is a policy, never a silent
max:

- ``per_partition``: keep one scale per partition (``CanonicalWeight.global_scale`` of shape
  [P]); exact; only for kernels whose declaration says ``per_partition_scales``.
- ``rescale``: pick the largest global multiplier G and rescale each partition's e4m3 block
  scales by g_p / G, re-rounded to e4m3: exact up to that rounding; the largest relative change
  of an effective block scale is reported.
- ``requantize``: FP8 per-tensor weights: re-encode each partition's elements under the largest
  scale (lossy; the largest change relative to the partition's absmax is reported).
- ``refuse``: raise a CheckpointError naming the members and their scales.

When the members' scales are equal the result is ``shared`` (nothing changes); schemes without
per-partition scalars (group / channel scales only) are ``concatenate`` (exact).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor

from qscheme.canonical import CanonicalWeight, dequantize, element_values
from qscheme.descriptor import Scheme
from qscheme.errors import CheckpointError, QuantizeError
from qscheme.formats import decode, get_element_format
from qscheme.scale_checks import regions_with_nonzero_elements, require_finite_dequantization

FusePolicy = Literal["per_partition", "rescale", "requantize", "refuse"]
FUSE_POLICIES: tuple[str, ...] = ("per_partition", "rescale", "requantize", "refuse")


@dataclass(frozen=True)
class FuseOutcome:
    """What fusing did to one module: the policy applied and how lossy it was."""

    module: str
    members: tuple[str, ...]
    policy: str  # shared, concatenate, per_partition, rescale, requantize
    scales_differ: bool
    partition_scales: tuple[float, ...] = ()
    max_relative_change: float | None = None
    detail: str = ""

    def describe(self) -> str:
        text = f"{self.module} = {' + '.join(self.members)}: {self.policy}"
        if self.max_relative_change is not None:
            text += f" (largest relative change {self.max_relative_change:.3g})"
        if self.detail:
            text += f"; {self.detail}"
        return text

    def as_json(self) -> dict[str, object]:
        return {
            "module": self.module,
            "members": list(self.members),
            "policy": self.policy,
            "scales_differ": self.scales_differ,
            "partition_scales": list(self.partition_scales),
            "max_relative_change": self.max_relative_change,
            "detail": self.detail,
        }


def partition_scalars(weight: CanonicalWeight) -> Tensor | None:
    """The per-partition weight scalars a fused layer could not share: the global scale
    multipliers, or the scale itself for per-tensor scales; None when there are none."""
    if weight.global_scale is not None:
        return weight.global_scale.reshape(-1).to(torch.float32)
    if weight.scheme.weight.scale.granularity == "tensor":
        return weight.scale.reshape(-1).to(torch.float32)
    return None


def _input_scalars(weight: CanonicalWeight) -> Tensor | None:
    for value in (weight.input_global_scale, weight.input_scale):
        if value is not None:
            return value.reshape(-1).to(torch.float32)
    return None


def _all_equal(values: Sequence[Tensor | None]) -> bool:
    present = [v for v in values if v is not None]
    if not present:
        return True
    flat = torch.cat([v.reshape(-1) for v in present])
    return bool((flat == flat[0]).all())


def scales_differ(members: Sequence[CanonicalWeight]) -> bool:
    """Whether the members' weight or static input scalars differ (a policy is then needed)."""
    return not _all_equal([partition_scalars(m) for m in members]) or not _all_equal(
        [_input_scalars(m) for m in members]
    )


def _check_compatible(module: str, names: Sequence[str], members: Sequence[CanonicalWeight]) -> Scheme:
    first = members[0]
    for name, member in zip(names[1:], members[1:], strict=True):
        if member.scheme.name != first.scheme.name:
            raise CheckpointError(
                f"cannot fuse {module}: {names[0]} uses {first.scheme.name} but {name} uses {member.scheme.name}; "
                "fused members must share one scheme (drop this module from fuse=)"
            )
        if member.k != first.k:
            raise CheckpointError(
                f"cannot fuse {module}: {names[0]} has K={first.k} but {name} has K={member.k}; "
                "fused members must read the same input"
            )
    pre = [m.input_pre_scale for m in members]
    if any(p is not None for p in pre) and not (
        all(p is not None for p in pre) and all(torch.equal(pre[0], p) for p in pre[1:])  # type: ignore[arg-type]
    ):
        raise CheckpointError(
            f"cannot fuse {module}: the members' input pre-scales (AWQ pre_quant_scale) differ; they multiply "
            "the one shared input, so the members cannot form one layer"
        )
    spec = first.scheme.weight.scale
    if spec.granularity == "block":
        assert spec.block is not None
        for name, member in zip(names, members, strict=True):
            if member.n % spec.block[0]:
                raise CheckpointError(
                    f"cannot fuse {module}: {name} has N={member.n}, not a multiple of the {spec.block[0]}-row "
                    "scale blocks, so its edge block would straddle two partitions"
                )
    return first.scheme


def _cat(values: Sequence[Tensor | None]) -> Tensor | None:
    if any(v is None for v in values):
        return None
    return torch.cat([v.reshape(-1) if v.dim() <= 1 else v for v in values if v is not None], dim=0)


def concatenate(members: Sequence[CanonicalWeight]) -> CanonicalWeight:
    """The members stacked along N with every per-partition value kept (exact)."""
    first = members[0]
    order = first.input_permutation
    if any(
        (member.input_permutation is None) != (order is None)
        or (
            order is not None
            and member.input_permutation is not None
            and not torch.equal(member.input_permutation, order)
        )
        for member in members
    ):
        raise CheckpointError(
            f"fused layer of {first.scheme.name}: its members hold their input channels in different orders "
            "(GPTQ act-order g_idx), so their codes cannot share one input; load the members as separate layers"
        )
    partitions: tuple[int, ...] = ()
    for member in members:
        partitions += member.partitions or (member.n,)
    scale = torch.cat([m.scale.reshape(-1) if m.scale.dim() <= 1 else m.scale for m in members], dim=0)
    return replace(
        first,
        n=sum(m.n for m in members),
        codes=torch.cat([m.codes for m in members], dim=0),
        scale=scale,
        global_scale=_cat([m.global_scale for m in members]),
        global_scale_divisor=_cat([m.global_scale_divisor for m in members]),
        zero_point=None if first.zero_point is None else torch.cat([m.zero_point for m in members], dim=0),  # type: ignore[misc]
        partitions=partitions,
        input_scale=_cat([m.input_scale for m in members]),
        input_global_scale=_cat([m.input_global_scale for m in members]),
        input_global_scale_divisor=_cat([m.input_global_scale_divisor for m in members]),
        input_pre_scale=first.input_pre_scale,
    )


def _unify_inputs(fused: CanonicalWeight) -> tuple[CanonicalWeight, str]:
    """Static input scales shared across partitions: the largest multiplier (no clipping)."""
    notes = []
    value = fused.input_scale
    if value is not None and not bool((value == value[0]).all()):
        fused = replace(fused, input_scale=torch.full_like(value, float(value.max())))
        notes.append(f"input_scale unified to the largest multiplier {float(value.max()):.6g} (lossy)")
    value = fused.input_global_scale
    if value is not None and not bool((value == value[0]).all()):
        top = int(value.argmax())
        divisor = fused.input_global_scale_divisor
        fused = replace(
            fused,
            input_global_scale=torch.full_like(value, float(value.max())),
            input_global_scale_divisor=None if divisor is None else divisor[top].repeat(len(value)),
        )
        notes.append(f"input_global_scale unified to the largest multiplier {float(value.max()):.6g} (lossy)")
    return fused, "; ".join(notes)


def rescale(fused: CanonicalWeight, module: str = "", names: Sequence[str] = ()) -> tuple[CanonicalWeight, float]:
    """Shared global scale G = max(g_p); block scales times g_p / G, re-rounded to their format.

    CheckpointError (naming ``module`` and the member among ``names``) when a nonzero block
    scale over nonzero elements rounds to zero, or the result cannot dequantize: a member
    whose global scale is far below G would lose those weights, not just their last bits.
    """
    scheme = fused.scheme
    spec = scheme.weight.scale
    if fused.global_scale is None or spec.granularity not in ("group", "channel") or spec.format != "e4m3":
        raise CheckpointError(
            f"scheme {scheme.name}: 'rescale' needs e4m3 group scales under a global scale; "
            f"use 'requantize' (per-tensor FP8), 'per_partition' or 'refuse'"
        )
    multipliers = fused.global_scale.to(torch.float64)
    top = int(torch.argmax(multipliers))
    shared = multipliers[top]
    divisor = fused.global_scale_divisor
    if divisor is not None:
        # Ratios from the stored divisors: s / d_p == s' / d_top  =>  s' = s * d_top / d_p.
        ratios = divisor.to(torch.float64)[top] / divisor.to(torch.float64)
    else:
        ratios = multipliers / shared
    rows = torch.tensor(fused.partitions)
    row_ratio = ratios.repeat_interleave(rows).reshape(-1, 1)
    old = fused.scale.to(torch.float64)
    new = (old * row_ratio).to(torch.float8_e4m3fn)
    wanted = old * row_ratio
    nonzero = wanted != 0
    change = ((new.to(torch.float64) - wanted).abs() / wanted.abs().clamp_min(1e-300))[nonzero]
    max_change = float(change.max()) if change.numel() else 0.0
    count = len(fused.partitions)
    result = replace(
        fused,
        scale=new,
        global_scale=fused.global_scale[top].repeat(count).to(torch.float32),
        global_scale_divisor=None if divisor is None else divisor[top].repeat(count),
    )
    member_names = list(names) or [f"partition {index}" for index in range(count)]
    flushed = nonzero & (new.to(torch.float64) == 0)
    if bool(flushed.any()):
        # a nonzero scale over all-zero elements loses nothing: producers write zero ones there
        flushed &= regions_with_nonzero_elements(fused, old)
    if bool(flushed.any()):
        raise CheckpointError(_flush_message(module, member_names, fused, flushed, nonzero, ratios, top))
    try:
        require_finite_dequantization(result, module or None)
    except QuantizeError as error:
        raise CheckpointError(
            f"cannot fuse {module or 'the members'} with fuse_policy 'rescale': the rescaled layer cannot dequantize "
            f"({error}); choose fuse_policy='per_partition' (a kernel taking one scale per partition), or load the "
            "members unfused"
        ) from error
    return result, max_change


def _flush_message(
    module: str,
    names: Sequence[str],
    fused: CanonicalWeight,
    flushed: Tensor,
    nonzero: Tensor,
    ratios: Tensor,
    top: int,
) -> str:
    assert fused.global_scale is not None  # rescale's precondition
    lost = []
    for index, (rows_flushed, rows_nonzero) in enumerate(
        zip(flushed.split(list(fused.partitions)), nonzero.split(list(fused.partitions)), strict=True)
    ):
        count = int(rows_flushed.sum())
        if count:
            lost.append(
                f"{names[index]}: {count} of {int(rows_nonzero.sum())} nonzero block scales (global multiplier "
                f"{float(fused.global_scale[index]):.6g}, rescaled by {float(ratios[index]):.3g})"
            )
    shared = f"{names[top]}'s {float(fused.global_scale[top]):.6g}"
    return (
        f"cannot fuse {module or 'the members'} with fuse_policy 'rescale': under the shared global multiplier "
        f"({shared}) these block scales round to zero in {fused.scheme.weight.scale.format}, which would zero weights "
        f"that are not zero: {'; '.join(lost)}; choose fuse_policy='per_partition' (a kernel taking one scale per "
        "partition), or load the members unfused (drop this module from fuse=)"
    )


def requantize(fused: CanonicalWeight) -> tuple[CanonicalWeight, float]:
    """FP8 per-tensor: re-encode every partition under the largest scale (lossy)."""
    scheme = fused.scheme
    spec = scheme.weight.scale
    element = get_element_format(scheme.weight.format)
    eight_bit_float = element.kind == "float" and element.bits == 8
    if spec.granularity != "tensor" or not eight_bit_float or fused.global_scale is not None:
        raise CheckpointError(
            f"scheme {scheme.name}: 'requantize' re-encodes FP8 weights with per-tensor scales; "
            "use 'rescale', 'per_partition' or 'refuse' for this scheme"
        )
    before = dequantize(fused)
    scales = fused.scale.reshape(-1).to(torch.float32)
    shared = scales.max()
    rows = torch.tensor(fused.partitions)
    values = element_values(fused) * scales.repeat_interleave(rows).reshape(-1, 1)
    codes = (values / shared).to(element.storage_dtype)
    result = replace(fused, codes=codes, scale=shared.repeat(len(fused.partitions)).to(fused.scale.dtype))
    after = dequantize(result)
    worst = 0.0
    start = 0
    for size in fused.partitions:
        part = before[start : start + size]
        peak = float(part.abs().max())
        if peak > 0:
            worst = max(worst, float((after[start : start + size] - part).abs().max()) / peak)
        start += size
    return result, worst


def fuse_members(
    module: str, names: Sequence[str], members: Sequence[CanonicalWeight], policy: str
) -> tuple[CanonicalWeight, FuseOutcome]:
    """One CanonicalWeight from several members, applying ``policy`` where their scales differ."""
    if policy not in FUSE_POLICIES:
        raise CheckpointError(f"fuse policy {policy!r} is not one of {', '.join(FUSE_POLICIES)}")
    _check_compatible(module, names, members)
    fused = concatenate(members)
    scalars = partition_scalars(fused)
    shown = tuple(float(v) for v in scalars) if scalars is not None else ()
    differ = scales_differ(members)
    base = {"module": module, "members": tuple(names), "scales_differ": differ, "partition_scales": shown}
    if not differ:
        kind = "shared" if scalars is not None or _input_scalars(fused) is not None else "concatenate"
        return fused, FuseOutcome(policy=kind, **base)  # type: ignore[arg-type]
    if policy == "refuse":
        listing = ", ".join(f"{n}={v:.6g}" for n, v in zip(names, shown, strict=False))
        inputs = _input_scalars(fused)
        if inputs is not None and not _all_equal([inputs]):
            listing += "; input scales " + ", ".join(f"{v:.6g}" for v in inputs.tolist())
        raise CheckpointError(
            f"cannot fuse {module}: the members' scales differ ({listing}) and the policy is 'refuse'; "
            "choose fuse_policy='per_partition' (a kernel taking one scale per partition), 'rescale' or "
            "'requantize', or load the members unfused"
        )
    if policy == "per_partition":
        return fused, FuseOutcome(policy="per_partition", **base)  # type: ignore[arg-type]
    weight_differ = scalars is not None and not _all_equal([scalars])
    change: float | None = None
    if weight_differ:
        if policy == "rescale":
            fused, change = rescale(fused, module, names)
        else:
            fused, change = requantize(fused)
    fused, note = _unify_inputs(fused)
    return fused, FuseOutcome(policy=policy, max_relative_change=change, detail=note, **base)  # type: ignore[arg-type]


def effective_block_scales(weight: CanonicalWeight) -> Tensor:
    """Block scale x global multiplier per row, float32 (for reports and tests)."""
    spec = weight.scheme.weight.scale
    scale = decode(weight.scale, "e8m0") if spec.format == "e8m0" else weight.scale.to(torch.float32)
    if weight.global_scale is None:
        return scale
    rows = torch.tensor(weight.partitions)
    return scale * weight.global_scale.repeat_interleave(rows).reshape(-1, 1)
