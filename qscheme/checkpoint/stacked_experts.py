"""Stacked experts split into one module per expert, from the headers alone.

Some producers store every expert of a fused experts module in one tensor per projection
(gpt-oss: ``<experts>.gate_up_proj_blocks`` [E, R, C/32, 16]), as their producer's
``StackedExperts`` declares. ``split_stacked_experts`` turns each such tensor into E tensors
``<experts>.<e>.<projection>.<tensor>``, each the header entry of one expert's bytes (the same
file, an offset into the stacked tensor): detection, layout checks, loading, ``inspect`` and
``apply_to_model`` then see the per-expert modules every other producer stores, and loading reads
one expert at a time, never the whole stack.

Strict: every tensor under a module holding stacked experts must be one of its projections'
tensors, every such tensor must have the same number of experts, and a folded tensor must end in
its declared size; anything else is a CheckpointError naming the tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from qscheme.errors import CheckpointError
from qscheme.producers.base import StackedExperts, natural_key, split_name
from qscheme.storage import TensorInfo
from qscheme.text import shown, shown_file

__all__ = ["split_stacked_experts"]


def _parts(short: str, layout: StackedExperts) -> tuple[str, str] | None:
    """(projection, tensor) of a stacked tensor's own name (``gate_up_proj_blocks``), else None."""
    for projection in layout.projections:
        prefix = projection + layout.separator
        if short.startswith(prefix) and len(short) > len(prefix):
            return projection, short[len(prefix) :]
    return None


def _stacked_modules(tensors: Mapping[str, TensorInfo], layout: StackedExperts) -> dict[str, dict[str, TensorInfo]]:
    """Module -> its tensors, for every module with at least one stacked projection tensor."""
    modules: dict[str, dict[str, TensorInfo]] = {}
    for name, info in tensors.items():
        module, short = split_name(name)
        modules.setdefault(module, {})[short] = info
    return {m: members for m, members in modules.items() if any(_parts(s, layout) for s in members)}


def _expected(layout: StackedExperts) -> str:
    names = [f"{p}{layout.separator}<tensor>" for p in layout.projections]
    return ", ".join(names)


def _expert_count(module: str, members: Mapping[str, TensorInfo], layout: StackedExperts) -> int:
    counts: dict[int, str] = {}
    for short, info in sorted(members.items()):
        if _parts(short, layout) is None:
            raise CheckpointError(
                f"{shown_file(info.file)}: tensor {shown(info.name)!r} ({info.dtype} {list(info.shape)}) sits in "
                f"{shown(module)!r}, whose experts are stored stacked ({_expected(layout)}), but it belongs to none of "
                f"the projections {', '.join(layout.projections)}: an orphan tensor the producer's layout does not "
                "declare; remove it, or re-export the checkpoint"
            )
        if len(info.shape) < 2 or info.shape[0] < 1:
            raise CheckpointError(
                f"{shown_file(info.file)}: tensor {shown(info.name)!r} is {list(info.shape)}; a stacked experts "
                "tensor has a leading expert dimension and at least one more: [E, ...]"
            )
        counts.setdefault(info.shape[0], info.name)
    if len(counts) > 1:
        found = ", ".join(f"{shown(name)!r}: {count}" for count, name in sorted(counts.items()))
        raise CheckpointError(
            f"{shown_file(next(iter(members.values())).file)}: the stacked experts tensors of {shown(module)!r} "
            f"disagree on the number of experts (leading dimension; {found}); every tensor of one experts module "
            "holds every expert: re-export the checkpoint"
        )
    return next(iter(counts))


def _unfolded_shape(info: TensorInfo, tensor: str, layout: StackedExperts) -> tuple[int, ...]:
    """One expert's shape, with a folded tensor's last two dimensions made one."""
    shape = tuple(info.shape[1:])
    size = layout.folded.get(tensor)
    if size is None:
        return shape
    if len(shape) < 2 or shape[-1] != size:
        raise CheckpointError(
            f"{shown_file(info.file)}: tensor {shown(info.name)!r} is {list(info.shape)}; its producer stores "
            f"{tensor!r} as [E, ..., {size}] ({size} bytes per group of codes, a trailing dimension of {size}), "
            "so this is not its layout (transposed, or from another format): re-export the checkpoint"
        )
    return (*shape[:-2], shape[-2] * shape[-1])


def split_stacked_experts(tensors: Mapping[str, TensorInfo], layout: StackedExperts) -> dict[str, TensorInfo]:
    """``tensors`` with every stacked experts tensor replaced by its per-expert entries (see the
    module docstring); other tensors unchanged. Reads no data."""
    stacked = _stacked_modules(tensors, layout)
    if not stacked:
        return dict(tensors)
    out = {name: info for name, info in tensors.items() if split_name(name)[0] not in stacked}
    for module, members in sorted(stacked.items(), key=lambda item: natural_key(item[0])):
        experts = _expert_count(module, members, layout)
        for short, info in sorted(members.items()):
            parts = _parts(short, layout)
            assert parts is not None  # _expert_count refused the others
            projection, tensor = parts
            shape = _unfolded_shape(info, tensor, layout)
            per_expert = info.nbytes // experts
            for expert in range(experts):
                name = f"{module}.{expert}.{projection}.{tensor}"
                if name in out:  # a stored tensor already has the name one expert's share gets
                    raise CheckpointError(
                        f"{shown_file(info.file)}: tensor {shown(name)!r} is stored beside the stacked tensor "
                        f"{shown(info.name)!r}, whose expert {expert} it would also be: the checkpoint holds two "
                        "values for one tensor; remove the stray per-expert tensor or re-export the checkpoint"
                    )
                out[name] = dataclasses.replace(info, name=name, shape=shape, offset=info.offset + expert * per_expert)
    return out


def split_for_producer(config: object, tensors: Mapping[str, TensorInfo]) -> dict[str, TensorInfo] | None:
    """``split_stacked_experts`` with the layout of the producer whose reader returned ``config``;
    None when that producer stores no stacked experts (or there is no producer config)."""
    from qscheme.producers import PRODUCERS

    layout = next((p.stacked_experts for p in PRODUCERS if isinstance(config, p.config_type)), None)
    return None if layout is None else split_stacked_experts(tensors, layout)
