"""``QschemeLinearMethod``: one vLLM linear layer (possibly fused) run by a qscheme kernel.

``create_weights`` declares the members' checkpoint tensors as vLLM parameters (``params``);
``process_weights_after_loading`` checks each member's tensors as qscheme's loader does, builds
their CanonicalWeight, concatenates the members along N with one global scale per member (exact:
``qscheme.checkpoint.fuse.concatenate``) and holds the result as a ``QuantLinear``, whose kernel
qscheme's resolver picks for the layer's device and activation dtype (members whose input channels
are permuted differently, GPTQ act-order, are held as one QuantLinear each: ``MemberLinears``;
a row-parallel rank's GPTQ ``g_idx`` is rebased to number its own groups from 0, as qscheme's TP
rules say). vLLM's parameters are then
dropped: the canonical tensors and the kernel's prepared form are what the layer keeps.
``apply`` runs the QuantLinear (the kernel's registered code) and adds vLLM's bias.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from vllm.model_executor.layers.linear import LinearMethodBase, register_weight_loader_v2_supported_method

from qscheme.canonical import canonicalize
from qscheme.canonical_weight import CanonicalWeight
from qscheme.checkpoint.fuse import concatenate
from qscheme.descriptor import Scheme
from qscheme.modules.linear import QuantLinear
from qscheme.parallel.rules import ShardLayout, Style, shard_layout
from qscheme.tensor_checks import ModuleLayout, require_valid_tensors
from qscheme.vllm.params import DeclaredTensor, VllmLayerError, declare, make_parameter, parameter_name

HOLDER = "qscheme_linear"
"""The attribute of a vLLM layer that holds its QuantLinear (MemberLinears for fused members in
different input orders) once the weights are loaded."""
DECLARED = "qscheme_declared"  # how each checkpoint tensor is held, from create_weights to loading
ACTIVATION_DTYPE = "qscheme_activation_dtype"


@dataclass(frozen=True)
class MemberFacts:
    """One checkpoint module of a vLLM layer: its name, N, K and stored tensors (dtype, shape)."""

    module: str
    n: int
    k: int
    tensors: tuple[tuple[str, str, tuple[int, ...]], ...]  # (name, torch dtype name, stored shape)

    @staticmethod
    def of(layout: ModuleLayout[Any]) -> MemberFacts:
        tensors = tuple((name, str(info.dtype), tuple(info.shape)) for name, info in layout.declared.items())
        return MemberFacts(layout.module, layout.n, layout.k, tensors)


def request_amx() -> None:
    """Ask the kernel for the AMX tile registers (Linux: ``arch_prctl(ARCH_REQ_XCOMP_PERM)``, once
    per process, through torch), where the CPU has them.

    vLLM's CPU attention for bfloat16 runs AMX tile instructions (``cpu_attn_amx``) without asking
    for them: it relies on oneDNN, whose bf16 GEMMs in vLLM's unquantized linear layers ask first.
    A model whose every linear layer is qscheme's never reaches oneDNN, and the first attention call
    then dies of SIGILL (Illegal instruction)."""
    cpu = getattr(torch, "cpu", None)
    supported = getattr(cpu, "_is_amx_tile_supported", None)
    init = getattr(cpu, "_init_amx", None)
    if supported is not None and init is not None and supported():
        init()


def _torch_dtype(layer: str, name: str, text: str) -> torch.dtype:
    dtype = getattr(torch, text, None)
    if not isinstance(dtype, torch.dtype):
        raise VllmLayerError(f"{layer}.{name}: the checkpoint's dtype {text} has no torch dtype vLLM can hold")
    return dtype


def _rank_groups(layer: str, module: str, name: str, group_index: Tensor, rank: int, groups: int) -> Tensor:
    """Rank ``rank``'s slice of a row-parallel layer's group index (GPTQ ``g_idx``), numbering its
    ``groups`` groups from 0; VllmLayerError where its columns belong to other ranks' groups (act-order)."""
    values = group_index - rank * groups
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >= groups):
        raise VllmLayerError(
            f"{layer}: {module}.{name} assigns the input channels of tensor-parallel rank {rank} to groups "
            f"{int(group_index.min())}..{int(group_index.max())}, while the rank holds the scales of groups "
            f"{rank * groups}..{(rank + 1) * groups - 1} (GPTQ act-order: groups out of order); a row-parallel "
            "split needs each rank's channels in its own groups: serve with tensor_parallel_size=1, or "
            "re-quantize without act-order (desc_act: false)"
        )
    return values


def _same_input_order(weights: Sequence[CanonicalWeight]) -> bool:
    """Whether the members hold their input channels in one order (None: the input's own), so that
    their codes can share one input and be concatenated into one weight."""
    orders = [weight.input_permutation for weight in weights]
    first = orders[0]
    if first is None:
        return all(order is None for order in orders)
    return all(order is not None and torch.equal(order, first) for order in orders)


class MemberLinears(torch.nn.Module):
    """The members of a fused layer whose input channels are permuted differently (GPTQ act-order:
    each member's ``g_idx`` orders its own groups): one QuantLinear each, on its own kernel, their
    outputs concatenated along N in the members' order (exact: each computes its own rows)."""

    def __init__(self, members: Sequence[QuantLinear]) -> None:
        super().__init__()
        self.members = torch.nn.ModuleList(members)

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([member(x) for member in self.members], dim=-1)


@register_weight_loader_v2_supported_method
class QschemeLinearMethod(LinearMethodBase):  # type: ignore[misc]
    """vLLM's linear method for the members of one layer, all of one qscheme scheme."""

    def __init__(self, layer_name: str, scheme: Scheme, members: Sequence[MemberFacts]) -> None:
        self.layer_name = layer_name
        self.scheme = scheme
        self.members = tuple(members)

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        shards = self._shards(layer, input_size_per_partition, input_size, output_partition_sizes)
        ns = [shard.shard_n for shard in shards]
        k = shards[0].shard_k
        self.shard_shapes = tuple((shard.shard_n, shard.shard_k) for shard in shards)
        self.rebases = tuple({n: t.rebase for n, t in shard.tensors.items() if t.rebase} for shard in shards)
        weight_loader = extra_weight_attrs["weight_loader"]
        specs = {spec.name: spec for spec in self.scheme.tensor_specs().values()}
        weight_name = self.scheme.weight.tensor.name
        names = [name for name, _, _ in self.members[0].tensors]
        declared: dict[str, DeclaredTensor] = {}
        for name in names:
            per_member = {m.module: {t[0]: t for t in m.tensors} for m in self.members}
            missing = [module for module, tensors in per_member.items() if name not in tensors]
            if missing:
                raise VllmLayerError(
                    f"{self.layer_name}: {self.members[0].module}.{name} has no counterpart in {', '.join(missing)}; "
                    "the members of a fused layer must store the same tensors"
                )
            stored = [
                (name, text, shard.tensors[name].shard_shape if name in shard.tensors else shape)
                for (_, text, shape), shard in zip(
                    [per_member[m.module][name] for m in self.members], shards, strict=True
                )
            ]
            dtypes = {dtype for _, dtype, _ in stored}
            if len(dtypes) > 1:
                raise VllmLayerError(
                    f"{self.layer_name}.{name}: the members store it as {sorted(dtypes)}; one dtype is needed"
                )
            dtype = _torch_dtype(self.layer_name, name, stored[0][1])
            held = declare(self.layer_name, self.scheme, specs[name], dtype, [s[2] for s in stored], ns, k)
            declared[name] = held
            layer.register_parameter(parameter_name(name), make_parameter(held, name == weight_name, weight_loader))
        setattr(layer, DECLARED, declared)  # plain attributes of vLLM's module, until the weights are loaded
        setattr(layer, ACTIVATION_DTYPE, params_dtype)

    def _shards(
        self, layer: torch.nn.Module, k_per_rank: int, k_full: int, n_per_rank: Sequence[int]
    ) -> list[ShardLayout]:
        """Each member's split for this rank, by qscheme's descriptor-derived rules (ShardError,
        qscheme's message naming the layer and the degrees that work, where it cannot split)."""
        row = k_per_rank != k_full
        tp = k_full // k_per_rank if row else max(1, sum(m.n for m in self.members) // max(1, sum(n_per_rank)))
        style: Style = "row" if row else "column"
        shards = []
        for member in self.members:
            stored = {name: shape for name, _, shape in member.tensors}
            shards.append(
                shard_layout(self.scheme, member.n, member.k, style, tp, layer=member.module, stored_shapes=stored)
            )
        got = [shard.shard_n for shard in shards]
        if list(n_per_rank) != got or shards[0].shard_k != k_per_rank:
            raise VllmLayerError(
                f"{self.layer_name}: vLLM gives each of its {tp} ranks outputs {list(n_per_rank)} and K={k_per_rank}; "
                f"qscheme's {style}-parallel split of {', '.join(m.module for m in self.members)} gives N={got}, "
                f"K={shards[0].shard_k} (vLLM replicates KV heads when tensor_parallel_size exceeds their count, "
                "which the plugin does not yet): serve with a tensor_parallel_size that divides every member"
            )
        return shards

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        declared: dict[str, DeclaredTensor] = getattr(layer, DECLARED)
        weights = []
        device = torch.device("cpu")
        for index, member in enumerate(self.members):
            tensors: dict[str, Tensor] = {}
            rank = 0
            for name, held in declared.items():
                param = getattr(layer, parameter_name(name))
                device = param.device
                rank = int(getattr(param, "tp_rank", 0))
                tensors[name] = held.member(param.data.to("cpu"), index)
            for name, rebase in self.rebases[index].items():  # a group index split with K: this rank's groups from 0
                tensors[name] = _rank_groups(self.layer_name, member.module, name, tensors[name], rank, rebase)
            shape_tensor = self.scheme.weight.shape_tensor
            if shape_tensor is not None and shape_tensor.name in tensors:  # this rank's [N, K], not the layer's
                stored = tensors[shape_tensor.name]
                tensors[shape_tensor.name] = torch.tensor(self.shard_shapes[index], dtype=stored.dtype)
            n, k = require_valid_tensors(self.scheme, tensors, member.module)
            weights.append(canonicalize(self.scheme, tensors, n, k, layer=member.module))
        if device.type == "cpu":
            request_amx()
        for name in declared:
            delattr(layer, parameter_name(name))
        delattr(layer, DECLARED)
        dtype = getattr(layer, ACTIVATION_DTYPE)
        holder: torch.nn.Module
        if _same_input_order(weights):
            weight = weights[0] if len(weights) == 1 else concatenate(weights)
            holder = QuantLinear(weight, device=device, layer_name=self.layer_name, activation_dtype=dtype)
        else:  # GPTQ act-order members, each with its own g_idx: one kernel each, outputs side by side
            holder = MemberLinears(
                [
                    QuantLinear(w, device=device, layer_name=m.module, activation_dtype=dtype)
                    for w, m in zip(weights, self.members, strict=True)
                ]
            )
        setattr(layer, HOLDER, holder)

    def apply(self, layer: torch.nn.Module, x: Tensor, bias: Tensor | None = None) -> Tensor:
        y: Tensor = getattr(layer, HOLDER)(x)
        if bias is not None:
            y = y + bias
        return y
