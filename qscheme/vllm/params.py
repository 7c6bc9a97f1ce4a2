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
  ``MemberStackParameter``: one copy per member, filled by the member's shard id.

``ceil(N/b)`` (block scales), flat and state tensors are refused with ``VllmLayerError``: vLLM's
loaders cannot place them exactly yet.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


class MemberStackParameter(BasevLLMParameter):  # type: ignore[misc]
    """One copy of an N-free tensor per fused member ([P, *stored shape]), filled by shard id."""

    def _load_member(self, loaded_weight: Tensor, shard_id: object = 0, **_: Any) -> None:
        slot = self.data[shard_index(shard_id)]
        differ = [d for d, (a, b) in enumerate(zip(loaded_weight.shape, slot.shape, strict=False)) if a != b]
        if loaded_weight.dim() == slot.dim() and len(differ) == 1:  # split with K on a row-parallel rank
            size = slot.shape[differ[0]]
            loaded_weight = loaded_weight.narrow(differ[0], self.tp_rank * size, size)
        if tuple(loaded_weight.shape) != tuple(slot.shape):
            raise VllmLayerError(
                f"a tensor of shape {list(loaded_weight.shape)} was given for a slot of shape {list(slot.shape)}"
            )
        slot.copy_(loaded_weight)

    def load_column_parallel_weight(self, loaded_weight: Tensor) -> None:
        self._load_member(loaded_weight)

    def load_row_parallel_weight(self, loaded_weight: Tensor) -> None:
        self._load_member(loaded_weight)

    def load_merged_column_weight(self, loaded_weight: Tensor, **kwargs: Any) -> None:
        self._load_member(loaded_weight, **kwargs)

    def load_qkv_weight(self, loaded_weight: Tensor, **kwargs: Any) -> None:
        self._load_member(loaded_weight, **kwargs)


@dataclass(frozen=True)
class DeclaredTensor:
    """How one checkpoint tensor of a (possibly fused) layer is held: its members' stored shapes,
    its dtype, and the output dimension members are stacked along (None: one slot per member)."""

    name: str
    dtype: torch.dtype
    shapes: tuple[tuple[int, ...], ...]  # per member, as stored
    output_dim: int | None
    kind: str  # "column", "scalar" or "stack"
    dims: tuple[Dim, ...] = ()  # the declared shape the stored ones match (column tensors)

    def member(self, data: Tensor, index: int) -> Tensor:
        """Member ``index``'s tensor, as its checkpoint stored it (a copy of its own)."""
        if self.kind == "column":
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
    if spec.flat:
        raise VllmLayerError(
            f"{where}: a flat tensor cannot be placed by vLLM's loaders yet; serve this layer unquantized"
        )
    if all(len(shape) == 0 or shape == (1,) for shape in stored):
        return DeclaredTensor(spec.name, dtype, tuple(stored), None, "scalar")
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
    if any(first[i].ceil for i in out_dims) or len(out_dims) > 1:
        raise VllmLayerError(
            f"{where}: its shape {spec.describe_shapes()} splits N in blocks (ceil), which vLLM's fused loaders "
            "cannot place per member yet; serve this layer unquantized (ignore it) or unfused"
        )
    o = out_dims[0]
    rest = {shape[:o] + shape[o + 1 :] for shape in stored}
    if len(rest) > 1:
        raise VllmLayerError(f"{where}: the members' shapes {[list(s) for s in stored]} differ beyond dimension {o}")
    return DeclaredTensor(spec.name, dtype, tuple(stored), o, "column", first)


def make_parameter(declared: DeclaredTensor, is_weight: bool, weight_loader: Callable[..., Any]) -> BasevLLMParameter:
    """The vLLM parameter holding ``declared`` for every member."""
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
