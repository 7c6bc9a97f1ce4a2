"""``QschemeMoEMethod``: the routed experts of one vLLM MoE layer, each run by qscheme's kernels.

vLLM builds a MoE block's experts as one ``RoutedExperts`` module holding stacked parameters
(``w13_*`` for gate and up, ``w2_*`` for down, one slot per local expert) and loads a checkpoint's
per-expert modules (``<experts>.<e>.gate_proj`` ...) into them by calling each parameter's
``weight_loader(param, loaded_weight, weight_name, shard_id, expert_id)``, where ``shard_id`` is
``w1`` (gate), ``w3`` (up) or ``w2`` (down) and ``expert_id`` the global expert.

``create_weights`` declares the scheme's checkpoint tensors under those names (``w13_weight_packed``
[E, 2, *stored shape]: gate and up in their own slots, so each keeps its own global scale;
``w2_weight_packed`` [E, *stored shape]). Their loader (``ExpertTensorLoader``, called by vLLM's
``RoutedExperts.load_weights`` with the arguments above; vLLM's own ``RoutedExperts.weight_loader``
places a tensor by what its name contains, "scale", "zero", "weight_shape", which a scheme's
tensor names need not follow) takes each expert's tensor as stored, keeps
this rank's share by qscheme's descriptor-derived rules (gate and up split by rows, down by K:
``qscheme.parallel.rules.shard_layout``, ShardError where a split would cut a packed word or a
scale group) and places it in its expert's slot; experts another rank holds (expert parallelism)
are skipped. ``process_weights_after_loading`` checks every expert's tensors as qscheme's loader
does, builds each expert's canonical weights, concatenates gate and up into one ``gate_up_proj``
with one global scale per partition (exact: ``qscheme.checkpoint.fuse.concatenate``, never the
max of the two) and holds them all as a ``QuantExperts``: one ``QuantLinear`` per expert and
projection, on the kernel qscheme's resolver picks. vLLM's parameters are then dropped.

``apply`` is the reference path: vLLM's router has already chosen each token's experts and
weights (``topk_ids``, ``topk_weights``, its own top-k, renormalization and scaling); each chosen
expert computes ``down(act(gate(x)) * up(x))`` on its kernels and the results are summed, weighted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEParallelConfig
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.utils import set_weight_attrs

from qscheme.canonical import CanonicalWeight, canonicalize
from qscheme.checkpoint.fuse import concatenate
from qscheme.checkpoint.plan import Plan
from qscheme.descriptor import Scheme
from qscheme.modules.experts import ExpertsSpec, QuantExperts
from qscheme.modules.linear import QuantLinear
from qscheme.parallel.rules import ShardLayout, Style, TensorShard, shard_layout
from qscheme.tensor_checks import require_valid_tensors
from qscheme.vllm.linear_method import MemberFacts
from qscheme.vllm.params import VllmLayerError

HOLDER = "qscheme_experts"
"""The attribute of vLLM's RoutedExperts that holds its QuantExperts once the weights are loaded."""
SHARD_IDS = ("w1", "w3", "w2")
"""vLLM's shard ids of an expert's projections: gate (w1), up (w3), down (w2)."""
ACTIVATIONS: dict[MoEActivation, Callable[[Tensor], Tensor]] = {
    MoEActivation.SILU: torch.nn.functional.silu,
    MoEActivation.GELU: torch.nn.functional.gelu,
    MoEActivation.GELU_TANH: lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
}
"""The gated activations the reference path runs: ``act(gate) * up``."""


@dataclass(frozen=True)
class ExpertFacts:
    """One expert's checkpoint modules: gate (w1), up (w3) and down (w2), as stored."""

    gate: MemberFacts
    up: MemberFacts
    down: MemberFacts

    def of(self, shard_id: str) -> MemberFacts:
        return {"w1": self.gate, "w3": self.up, "w2": self.down}[shard_id]


def experts_method(plan: Plan, layer: torch.nn.Module, prefix: str, model_path: str | None) -> FusedMoEMethodBase:
    """The method of vLLM's routed experts ``prefix``: vLLM's own unquantized method when no
    expert projection is quantized in the checkpoint, ``QschemeMoEMethod`` when all are, of one
    scheme; VllmLayerError naming the layer otherwise."""
    from vllm.model_executor.layers.fused_moe import UnquantizedFusedMoEMethod

    moe: FusedMoEConfig = getattr(layer, "moe_config")  # noqa: B009 (a RoutedExperts, typed as a Module)
    names: tuple[str | None, ...] = tuple(
        getattr(layer, f"ckpt_{projection}_proj_name", None) for projection in ("gate", "up", "down")
    )
    pattern = ",".join(name for name in names if name)
    modules = [f"{prefix}.{e}.{name}" for e in range(moe.num_logical_experts) for name in names if name is not None]
    layouts = {module: plan.layouts.get(module) for module in modules}
    present = [layout for layout in layouts.values() if layout is not None]
    if not present:
        other = sorted(m for m in plan.layouts if m.startswith(f"{prefix}.") and m not in layouts)
        if other:
            shown = ", ".join(other[:3]) + (" ..." if len(other) > 3 else "")
            raise VllmLayerError(
                f"{prefix}: the checkpoint quantizes {shown}, which are not vLLM's per-expert projections "
                f"({prefix}.<e>.{{{pattern}}}); qscheme's MoE method reads one module per expert and projection: "
                "write the checkpoint so"
            )
        return UnquantizedFusedMoEMethod(moe)
    absent = [module for module, layout in layouts.items() if layout is None]
    if absent:
        shown = ", ".join(absent[:3]) + (f" and {len(absent) - 3} more" if len(absent) > 3 else "")
        raise VllmLayerError(
            f"{prefix}: {len(absent)} of its {len(modules)} expert projections are not quantized in {model_path} "
            f"({shown}) while the others are; vLLM runs all experts of a layer with one method: quantize all of "
            "them or none"
        )
    schemes = sorted({layout.scheme.name for layout in present})
    if len(schemes) > 1:
        raise VllmLayerError(
            f"{prefix}: its experts use different schemes ({', '.join(schemes)}); vLLM stacks the experts of a layer "
            "in one set of parameters, of one scheme: quantize them alike"
        )
    if names[1] is None:
        raise VllmLayerError(
            f"{prefix}: the experts have no up projection (non-gated); qscheme's MoE method runs gated ones"
        )
    facts = [
        ExpertFacts(*(MemberFacts.of(layouts[f"{prefix}.{e}.{name}"]) for name in names))  # type: ignore[arg-type]
        for e in range(moe.num_logical_experts)
    ]
    return QschemeMoEMethod(moe, prefix, present[0].scheme, facts)


class ExpertTensorLoader:
    """vLLM's per-expert weight loader for one checkpoint tensor of every expert (``w13_<name>``
    or ``w2_<name>``): this rank's share of the stored tensor, placed in its expert's slot."""

    def __init__(self, method: QschemeMoEMethod, layer: torch.nn.Module, name: str, stem: str) -> None:
        self.method = method
        self.layer = layer
        self.name = name
        self.stem = stem  # "w13" or "w2"

    def __call__(
        self,
        param: torch.nn.Parameter,
        loaded_weight: Tensor,
        weight_name: str = "",
        shard_id: str = "",
        expert_id: int = 0,
        return_success: bool = False,
    ) -> bool | None:
        method = self.method
        where = f"{method.layer_name}.{expert_id} ({weight_name or self.name})"
        expected_stem = "w2" if shard_id == "w2" else "w13"
        if shard_id not in SHARD_IDS or expected_stem != self.stem:
            raise VllmLayerError(
                f"{where}: vLLM gave shard id {shard_id!r} for {self.stem}_{self.name}; expected "
                f"{'w2' if self.stem == 'w2' else 'w1 or w3'}"
            )
        to_local = getattr(self.layer, "_map_global_expert_id_to_local_expert_id")  # noqa: B009
        local = int(to_local(expert_id))
        if local < 0:  # another rank's expert (expert parallelism)
            return False if return_success else None
        shard: TensorShard = method.shards[shard_id].tensors[self.name]
        if tuple(loaded_weight.shape) != shard.full_shape:
            raise VllmLayerError(
                f"{where}: {self.name} has shape {list(loaded_weight.shape)} in the checkpoint, but qscheme planned "
                f"{list(shard.full_shape)} from the headers; the files changed since the engine started"
            )
        rank = method.tp_rank
        part = loaded_weight if shard.rewrite else shard.values(rank, loaded_weight[shard.index(rank)])
        slot = param.data[local] if shard_id == "w2" else param.data[local, 0 if shard_id == "w1" else 1]
        slot.copy_(part.to(slot.dtype).reshape(slot.shape))
        method.loaded.add((local, shard_id, self.name))
        return True if return_success else None


class QschemeMoEMethod(FusedMoEMethodBase):  # type: ignore[misc]
    """vLLM's fused-MoE method for experts all quantized with one qscheme scheme (reference path)."""

    def __init__(self, moe: FusedMoEConfig, layer_name: str, scheme: Scheme, experts: Sequence[ExpertFacts]) -> None:
        super().__init__(moe)
        self.layer_name = layer_name
        self.scheme = scheme
        self.experts = tuple(experts)
        self.tp_rank = 0
        self.shards: dict[str, ShardLayout] = {}
        self.loaded: set[tuple[int, str, str]] = set()

    # -- sizes and tensors ------------------------------------------------------------------------

    def maybe_roundup_sizes(
        self,
        hidden_size: int,
        intermediate_size_per_partition: int,
        act_dtype: torch.dtype,
        moe_parallel_config: FusedMoEParallelConfig,
    ) -> tuple[int, int]:
        return hidden_size, intermediate_size_per_partition  # the checkpoint's shapes: no padding

    def _tensor_names(self) -> list[str]:
        """The tensors every expert projection stores (one scheme: the same names for all)."""
        first = self.experts[0].gate
        names = [name for name, _, _ in first.tensors]
        for expert in self.experts:
            for shard_id in SHARD_IDS:
                member = expert.of(shard_id)
                if sorted(name for name, _, _ in member.tensors) != sorted(names):
                    raise VllmLayerError(
                        f"{self.layer_name}: {member.module} stores {sorted(t[0] for t in member.tensors)} but "
                        f"{first.module} stores {sorted(names)}; every expert projection must store the same tensors"
                    )
        return names

    def _dtype(self, name: str) -> torch.dtype:
        texts = {text for e in self.experts for s in SHARD_IDS for n, text, _ in e.of(s).tensors if n == name}
        if len(texts) > 1:
            raise VllmLayerError(
                f"{self.layer_name}: the experts store {name} as {sorted(texts)}; one dtype is needed for the stacked "
                "parameter: quantize the experts alike"
            )
        text = texts.pop()
        dtype = getattr(torch, text, None)
        if not isinstance(dtype, torch.dtype):
            raise VllmLayerError(f"{self.layer_name}: the checkpoint's dtype {text} of {name} has no torch dtype")
        return dtype

    def _plan_shards(self, hidden_size: int, intermediate: int) -> None:
        """Each projection's split for this rank (every expert has the same shapes), checked
        against the sizes vLLM gives the layer."""
        parallel = self.moe.moe_parallel_config
        tp, self.tp_rank = int(parallel.tp_size), int(parallel.tp_rank)
        facts = self.experts[0]
        for expert in self.experts:
            for shard_id in SHARD_IDS:
                mine, first = expert.of(shard_id), facts.of(shard_id)
                if (mine.n, mine.k, mine.tensors) != (first.n, first.k, first.tensors):
                    raise VllmLayerError(
                        f"{self.layer_name}: {mine.module} is [{mine.n}, {mine.k}] with tensors {mine.tensors}, "
                        f"{first.module} is [{first.n}, {first.k}] with {first.tensors}; vLLM stacks experts of one "
                        "shape"
                    )
        styles: tuple[tuple[str, Style], ...] = (("w1", "column"), ("w3", "column"), ("w2", "row"))
        for shard_id, style in styles:
            member = facts.of(shard_id)
            stored = {name: shape for name, _, shape in member.tensors}
            self.shards[shard_id] = shard_layout(
                self.scheme, member.n, member.k, style, tp, layer=member.module, stored_shapes=stored
            )
        gate, down = self.shards["w1"], self.shards["w2"]
        if (gate.shard_n, gate.shard_k, down.shard_n, down.shard_k) != (
            intermediate,
            hidden_size,
            hidden_size,
            intermediate,
        ):
            raise VllmLayerError(
                f"{self.layer_name}: vLLM gives each of its {tp} ranks experts of hidden size {hidden_size} and "
                f"intermediate size {intermediate}; the checkpoint's {facts.gate.module} is [{facts.gate.n}, "
                f"{facts.gate.k}] and {facts.down.module} [{facts.down.n}, {facts.down.k}], split by qscheme to "
                f"[{gate.shard_n}, {gate.shard_k}] and [{down.shard_n}, {down.shard_k}]: serve the checkpoint with the "
                "config.json it was written with"
            )

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        if self.moe.activation not in ACTIVATIONS:
            raise VllmLayerError(
                f"{self.layer_name}: the experts' activation {self.moe.activation.value!r} is not one qscheme's MoE "
                f"method runs ({', '.join(a.value for a in ACTIVATIONS)}); serve this model without "
                "quantization='qscheme'"
            )
        limits = {"swiglu_limit": self.moe.swiglu_limit, "swiglu_alpha": self.moe.swiglu_alpha}
        if any(value is not None for value in limits.values()) or self.moe.intermediate_pad:
            raise VllmLayerError(
                f"{self.layer_name}: the experts' gating has parameters ({limits}, intermediate_pad "
                f"{self.moe.intermediate_pad}) qscheme's MoE method does not apply; serve this model without "
                "quantization='qscheme'"
            )
        if self.moe.has_bias:
            raise VllmLayerError(
                f"{self.layer_name}: the experts have biases, which qscheme's MoE method does not load yet; serve "
                "this model without quantization='qscheme'"
            )
        self._plan_shards(hidden_size, intermediate_size_per_partition)
        self.num_local_experts = num_experts
        self.params_dtype = params_dtype
        self.names = self._tensor_names()
        for name in self.names:
            dtype = self._dtype(name)
            for stem, shard_id, slots in (("w13", "w1", (2,)), ("w2", "w2", ())):
                shape = self.shards[shard_id].tensors[name].shard_shape
                data = torch.zeros((num_experts, *slots, *shape), dtype=dtype)
                param = torch.nn.Parameter(data, requires_grad=False)
                layer.register_parameter(f"{stem}_{name}", param)
                set_weight_attrs(param, {"weight_loader": ExpertTensorLoader(self, layer, name, stem)})

    # -- after loading ----------------------------------------------------------------------------

    def _global_ids(self, layer: torch.nn.Module) -> list[int]:
        """The global expert id of each local expert slot."""
        expert_map = getattr(layer, "_expert_map", None)
        if expert_map is None:
            return list(range(self.num_local_experts))
        ids = [-1] * self.num_local_experts
        for global_id, local in enumerate(expert_map.tolist()):
            if 0 <= local < self.num_local_experts:
                ids[local] = global_id
        return ids

    def _canonical(self, layer: torch.nn.Module, local: int, shard_id: str, module: str) -> CanonicalWeight:
        tensors: dict[str, Tensor] = {}
        stem = "w2" if shard_id == "w2" else "w13"
        missing = [name for name in self.names if (local, shard_id, name) not in self.loaded]
        if missing:
            raise VllmLayerError(
                f"{module}: vLLM loaded no {', '.join(missing)} for it from the checkpoint; every expert's tensors "
                "must be in the checkpoint's safetensors files"
            )
        for name in self.names:
            data = getattr(layer, f"{stem}_{name}").data.to("cpu")
            tensors[name] = (data[local] if shard_id == "w2" else data[local, 0 if shard_id == "w1" else 1]).clone()
        layout = self.shards[shard_id]
        shape_tensor = self.scheme.weight.shape_tensor
        if shape_tensor is not None and shape_tensor.name in tensors:  # this rank's [N, K], not the expert's
            stored = tensors[shape_tensor.name]
            tensors[shape_tensor.name] = torch.tensor((layout.shard_n, layout.shard_k), dtype=stored.dtype)
        n, k = require_valid_tensors(self.scheme, tensors, module)
        return canonicalize(self.scheme, tensors, n, k, layer=module)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        first = getattr(layer, f"w2_{self.names[0]}")
        device = first.device
        spec = ExpertsSpec(
            module=self.layer_name,
            module_type="vLLM RoutedExperts",
            num_experts=self.num_local_experts,
            hidden_size=self.shards["w2"].shard_n,
            intermediate_size=self.shards["w1"].shard_n,
        )
        experts = QuantExperts(spec, ACTIVATIONS[self.moe.activation])
        for local, global_id in enumerate(self._global_ids(layer)):
            facts = self.experts[global_id]
            gate = self._canonical(layer, local, "w1", facts.gate.module)
            up = self._canonical(layer, local, "w3", facts.up.module)
            down = self._canonical(layer, local, "w2", facts.down.module)
            for projection, weight in (("gate_up_proj", concatenate([gate, up])), ("down_proj", down)):
                name = f"{self.layer_name}.{global_id}.{projection}"
                linear = QuantLinear(weight, device=device, layer_name=name, activation_dtype=self.params_dtype)
                experts.set_layer(f"{local}.{projection}", linear)
        experts.require_complete()
        for name in self.names:
            delattr(layer, f"w13_{name}")
            delattr(layer, f"w2_{name}")
        self.loaded.clear()
        setattr(layer, HOLDER, experts)

    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> None:
        return None  # no vLLM MoE kernel runs these experts

    # -- computation ------------------------------------------------------------------------------

    def apply(
        self,
        layer: torch.nn.Module,
        x: Tensor,
        topk_weights: Tensor,
        topk_ids: Tensor,
        shared_experts: Any,
        shared_experts_input: Tensor | None,
    ) -> Tensor:
        experts: QuantExperts = getattr(layer, HOLDER)
        ids = topk_ids.long()
        expert_map = getattr(layer, "expert_map", None)
        if expert_map is not None:  # global ids -> this rank's slots; another rank's experts are skipped
            ids = expert_map.to(ids.device)[ids].long()
            ids = torch.where(ids < 0, torch.full_like(ids, experts.num_experts), ids)
        weights = topk_weights.to(x.dtype)
        if getattr(layer, "apply_router_weight_on_input", False):
            if ids.shape[-1] != 1:
                raise VllmLayerError(
                    f"{self.layer_name}: router weights applied to the input need top-1 routing, "
                    f"got top-{ids.shape[-1]}"
                )
            x, weights = x * weights, torch.ones_like(weights)
        out: Tensor = experts(x, ids, weights)
        return out
