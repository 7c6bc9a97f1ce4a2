"""vLLM parameters for a scheme's checkpoint tensors (the v2 weight loader's classes).

A vLLM linear layer may fuse several checkpoint modules (``qkv_proj`` = q, k, v; ``gate_up_proj`` =
gate, up): its parameters hold every member's tensor, stacked as vLLM's loader stacks them, and
``member_tensors`` gives each member's tensors back exactly as its checkpoint stored them.

Which class a tensor gets follows from its declared shape (``qscheme.descriptor.shapes``):

- a dimension ``N`` (or ``N/d``: packed along N) is the output dimension: ``ModelWeightParameter``
  for the weight, ``PackedvLLMParameter`` for codes packed along N or K (packed_dim and
  packed_factor from the declared divisor), ``GroupQuantScaleParameter`` for [N, K/g] scales,
  ``ChannelQuantScaleParameter`` for [N] / [N, 1] ones. vLLM places member p at the sum of the
  earlier members' sizes along that dimension;
- a scalar ([] or [1]: global scales, per-tensor scales, static input scales) is a
  ``PerTensorScaleParameter`` of one value per member: vLLM's fused loaders fill one slot each,
  so a fused layer keeps every member's own scale (never their max);
- any other tensor that has no N dimension (``weight_shape``, an input pre-scale [K]) is a
  ``MemberStackParameter``: one copy per member, filled by the member's shard id;
- a tensor whose members' sizes vLLM cannot compute is a ``MemberSliceParameter``: the members
  concatenated along one dimension, each at the offset of the earlier members' stored sizes,
  filled by shard id. Block scales (``ceil(N/128)`` along N: FP8_BLOCK, DeepSeek's 128x128
  blocks; a member of N = 320 holds 3 rows of scales, not 320/128) are concatenated along N; flat
  tensors (bitsandbytes' ``weight`` [N*K/2, 1] and absmax), JSON state tensors and tensors counted
  over the whole layer (``ceil(N*K/16384)``) along their first dimension.

Tensor-parallel shares come from qscheme's rules (``qscheme.parallel.rules.shard_layout``): a
block scale splits with its N or K in whole blocks; flat and state tensors count the whole layer,
and qscheme refuses to split such layers (ShardError) before any parameter is made.

Checkpoint tensor names may hold dots (bitsandbytes' ``weight.absmax``), which a torch parameter
name cannot: such a tensor is held as ``parameter_name(name)`` (``weight__absmax``), and the
method's checkpoint weight mapper (``checkpoint_renames``) gives vLLM's loader that name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from vllm.model_executor.parameter import (
    BasevLLMParameter,
    ChannelQuantScaleParameter,
    GroupQuantScaleParameter,
    ModelWeightParameter,
    PackedColumnParameter,
    PackedvLLMParameter,
    PerTensorScaleParameter,
)

from qscheme.descriptor import Scheme
from qscheme.descriptor.model import TensorSpec
from qscheme.descriptor.shapes import Dim
from qscheme.errors import CheckpointError


class VllmLayerError(CheckpointError):
    """A checkpoint module the vLLM plugin cannot declare or load: names the layer, tensor and why."""


_QKV = {"q": 0, "k": 1, "v": 2}


def shard_index(shard_id: object) -> int:
    """vLLM's shard id of a fused member (an int, or ``q``/``k``/``v``) as the member's index."""
    if isinstance(shard_id, int):
        return shard_id
    if isinstance(shard_id, str) and shard_id in _QKV:
        return _QKV[shard_id]
    raise VllmLayerError(f"vLLM gave the shard id {shard_id!r}; expected a member index or q, k, v")


def parameter_name(name: str) -> str:
    """The torch parameter name that holds checkpoint tensor ``name`` (dots are not allowed there)."""
    return name.replace(".", "__")


def checkpoint_renames(names: Iterable[str]) -> dict[str, str]:
    """vLLM weight-mapper suffixes (``.weight.absmax`` -> ``.weight__absmax``) for the checkpoint
    tensor names that hold dots, longest first (none is then the tail of one renamed before it)."""
    dotted = sorted({name for name in names if "." in name}, key=len, reverse=True)
    return {f".{name}": f".{parameter_name(name)}" for name in dotted}


def _rank_part(loaded_weight: Tensor, shape: Sequence[int], tp_rank: int) -> Tensor:
    """This rank's part of a checkpoint tensor for a slot of ``shape``: where exactly one
    dimension differs, the tensor-parallel split (qscheme's rules chose it; shard_layout checked
    that it holds whole units) is along it, rank r holding the r-th equal part."""
    differ = [d for d, (a, b) in enumerate(zip(loaded_weight.shape, shape, strict=False)) if a != b]
    if loaded_weight.dim() == len(shape) and len(differ) == 1:
        size = shape[differ[0]]
        loaded_weight = loaded_weight.narrow(differ[0], tp_rank * size, size)
    if tuple(loaded_weight.shape) != tuple(shape):
        raise VllmLayerError(
            f"a tensor of shape {list(loaded_weight.shape)} was given for a slot of shape {list(shape)}"
        )
    return loaded_weight


class _MemberLoads(BasevLLMParameter):  # type: ignore[misc]
    """vLLM's four loader entry points, all filling the slot of the member the shard id names."""

    def _load_member(self, loaded_weight: Tensor, shard_id: object = 0, **_: Any) -> None:
        raise NotImplementedError

    def load_column_parallel_weight(self, loaded_weight: Tensor) -> None:
        self._load_member(loaded_weight)

    def load_row_parallel_weight(self, loaded_weight: Tensor) -> None:
        self._load_member(loaded_weight)

    def load_merged_column_weight(self, loaded_weight: Tensor, **kwargs: Any) -> None:
        self._load_member(loaded_weight, **kwargs)

    def load_qkv_weight(self, loaded_weight: Tensor, **kwargs: Any) -> None:
        self._load_member(loaded_weight, **kwargs)


class MemberStackParameter(_MemberLoads):
    """One copy of an N-free tensor per fused member ([P, *stored shape]), filled by shard id."""

    def _load_member(self, loaded_weight: Tensor, shard_id: object = 0, **_: Any) -> None:
        slot = self.data[shard_index(shard_id)]
        slot.copy_(_rank_part(loaded_weight, slot.shape, self.tp_rank))


class MemberSliceParameter(_MemberLoads):
    """The members' tensors concatenated along ``slice_dim``, member i at the sum of the earlier
    members' ``slice_sizes``: block scales along N, flat and state tensors along their first
    dimension. Filled by shard id, each member with this rank's part of its tensor."""

    def __init__(self, slice_dim: int, slice_sizes: Sequence[int], **kwargs: Any) -> None:
        self.slice_dim = slice_dim
        self.slice_sizes = tuple(slice_sizes)
        super().__init__(**kwargs)

    def _load_member(self, loaded_weight: Tensor, shard_id: object = 0, **_: Any) -> None:
        index = shard_index(shard_id)
        if not 0 <= index < len(self.slice_sizes):
            raise VllmLayerError(f"vLLM gave member {index} of a layer of {len(self.slice_sizes)} members")
        start = sum(self.slice_sizes[:index])
        slot = self.data.narrow(self.slice_dim, start, self.slice_sizes[index])
        slot.copy_(_rank_part(loaded_weight, slot.shape, self.tp_rank))


@dataclass(frozen=True)
class DeclaredTensor:
    """How one checkpoint tensor of a (possibly fused) layer is held: its members' stored shapes,
    its dtype, and the output dimension members are stacked along (None: one slot per member)."""

    name: str
    dtype: torch.dtype
    shapes: tuple[tuple[int, ...], ...]  # per member, as stored
    output_dim: int | None  # the dimension members are concatenated along ("column", "slice")
    kind: str  # "column", "slice", "scalar" or "stack"
    dims: tuple[Dim, ...] = ()  # the declared shape the stored ones match (column tensors)

    def member(self, data: Tensor, index: int) -> Tensor:
        """Member ``index``'s tensor, as its checkpoint stored it (a copy of its own)."""
        if self.kind in ("column", "slice"):
            assert self.output_dim is not None
            start = sum(shape[self.output_dim] for shape in self.shapes[:index])
            size = self.shapes[index][self.output_dim]
            return data.narrow(self.output_dim, start, size).clone()
        return data[index].reshape(self.shapes[index]).clone()


def _matching_shape(spec: TensorSpec, stored: tuple[int, ...], n: int, k: int) -> tuple[Dim, ...] | None:
    for shape in spec.shapes:
        sizes = tuple(dim.evaluate(n, k) for dim in shape)
        if sizes == stored:
            return shape
    return None


def declare(
    layer: str,
    scheme: Scheme,
    spec: TensorSpec,
    dtype: torch.dtype,
    stored: Sequence[tuple[int, ...]],
    ns: Sequence[int],
    k: int,
) -> DeclaredTensor:
    """How tensor ``spec`` of the members (output sizes ``ns``, input size ``k``) is stacked."""
    where = f"{layer}.{spec.name} (scheme {scheme.name})"
    if all(len(shape) == 0 or shape == (1,) for shape in stored):
        return DeclaredTensor(spec.name, dtype, tuple(stored), None, "scalar")
    whole_layer = spec.flat or not spec.shapes or any(dim.variable == "N*K" for shape in spec.shapes for dim in shape)
    if whole_layer:  # flat, JSON state, counted over the whole layer: each member's own piece
        return _slices(where, spec.name, dtype, stored, 0)
    dims = [_matching_shape(spec, shape, n, k) for shape, n in zip(stored, ns, strict=True)]
    if any(d is None for d in dims):
        raise VllmLayerError(
            f"{where}: stored shapes {[list(s) for s in stored]} match none of {spec.describe_shapes()}"
        )
    first = dims[0]
    assert first is not None
    out_dims = [i for i, dim in enumerate(first) if dim.variable == "N"]
    if not out_dims:
        return DeclaredTensor(spec.name, dtype, tuple(stored), None, "stack")
    if len(out_dims) > 1:
        raise VllmLayerError(f"{where}: its shape {spec.describe_shapes()} has N in more than one dimension")
    o = out_dims[0]
    if first[o].ceil:  # blocks along N: a member's rows of blocks, which vLLM's offsets do not count
        return _slices(where, spec.name, dtype, stored, o)
    rest = {shape[:o] + shape[o + 1 :] for shape in stored}
    if len(rest) > 1:
        raise VllmLayerError(f"{where}: the members' shapes {[list(s) for s in stored]} differ beyond dimension {o}")
    return DeclaredTensor(spec.name, dtype, tuple(stored), o, "column", first)


def _slices(where: str, name: str, dtype: torch.dtype, stored: Sequence[tuple[int, ...]], dim: int) -> DeclaredTensor:
    """Members concatenated along ``dim``, which must be their only dimension of different sizes."""
    if any(len(shape) <= dim for shape in stored):
        raise VllmLayerError(f"{where}: stored shapes {[list(s) for s in stored]} have no dimension {dim}")
    rest = {shape[:dim] + shape[dim + 1 :] for shape in stored}
    if len(rest) > 1:
        raise VllmLayerError(f"{where}: the members' shapes {[list(s) for s in stored]} differ beyond dimension {dim}")
    return DeclaredTensor(name, dtype, tuple(stored), dim, "slice")


def make_parameter(declared: DeclaredTensor, is_weight: bool, weight_loader: Callable[..., Any]) -> BasevLLMParameter:
    """The vLLM parameter holding ``declared`` for every member."""
    if declared.kind == "slice":
        assert declared.output_dim is not None
        d = declared.output_dim
        sizes = [shape[d] for shape in declared.shapes]
        shape = list(declared.shapes[0])
        shape[d] = sum(sizes)
        data = torch.zeros(shape, dtype=declared.dtype)
        return MemberSliceParameter(slice_dim=d, slice_sizes=sizes, data=data, weight_loader=weight_loader)
    if declared.kind == "scalar":
        data = torch.zeros(len(declared.shapes), dtype=declared.dtype)
        return PerTensorScaleParameter(data=data, weight_loader=weight_loader)
    if declared.kind == "stack":
        data = torch.zeros((len(declared.shapes), *declared.shapes[0]), dtype=declared.dtype)
        return MemberStackParameter(data=data, weight_loader=weight_loader)
    o = declared.output_dim
    assert o is not None
    shape = list(declared.shapes[0])
    shape[o] = sum(s[o] for s in declared.shapes)
    data = torch.zeros(shape, dtype=declared.dtype)
    dims = declared.dims
    n_dim = dims[o]
    k_dims = [i for i, dim in enumerate(dims) if dim.variable == "K"]
    i = k_dims[0] if k_dims else None
    if n_dim.divisor > 1:  # packed along N (zero points of int4 asym, [N/8, K/g])
        if i is None:
            return PackedColumnParameter(
                data=data, output_dim=o, packed_dim=o, packed_factor=n_dim.divisor, weight_loader=weight_loader
            )
        return PackedvLLMParameter(
            data=data, output_dim=o, input_dim=i, packed_dim=o, packed_factor=n_dim.divisor, weight_loader=weight_loader
        )
    if i is None:
        return ChannelQuantScaleParameter(data=data, output_dim=o, weight_loader=weight_loader)
    if is_weight and dims[i].divisor > 1:  # codes packed along K ([N, K/8] int32, [N, K/2] fp4 pairs)
        return PackedvLLMParameter(
            data=data,
            output_dim=o,
            input_dim=i,
            packed_dim=i,
            packed_factor=dims[i].divisor,
            weight_loader=weight_loader,
        )
    if is_weight:
        return ModelWeightParameter(data=data, output_dim=o, input_dim=i, weight_loader=weight_loader)
    return GroupQuantScaleParameter(data=data, output_dim=o, input_dim=i, weight_loader=weight_loader)
