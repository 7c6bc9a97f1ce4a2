"""How vLLM groups a checkpoint's modules into the layers it builds (no vLLM import).

vLLM fuses some projections into one layer: ``q_proj``, ``k_proj`` and ``v_proj`` load into
``qkv_proj``, ``gate_proj`` and ``up_proj`` into ``gate_up_proj``. A model class says which in its
``packed_modules_mapping`` (fused name -> member names), which vLLM hands to the quantization
config. ``fused_members`` is what the qscheme plugin (``qscheme.vllm.config``) asks for every
layer vLLM builds; ``vllm_layers`` goes the other way, from a checkpoint's modules to vLLM's layer
names, for ``qscheme resolve PATH --engine vllm``. Both use the same mapping.

Outside vLLM the mapping comes from the checkpoint's ``architectures`` (``PACKED_MODULES``, copied
from vLLM 0.32's model classes; tests/test_vllm_layers.py compares it with them), Llama's when the
architecture is not listed. Experts (``<prefix>.experts.<e>.<projection>``) are one vLLM layer,
the fused-MoE layer ``<prefix>.experts``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

PackedModules = Mapping[str, Sequence[str]]

LLAMA_PACKED_MODULES: PackedModules = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
ATTENTION_ONLY: PackedModules = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
MLP_ONLY: PackedModules = {"gate_up_proj": ("gate_proj", "up_proj")}

PACKED_MODULES: Mapping[str, PackedModules] = {
    "LlamaForCausalLM": LLAMA_PACKED_MODULES,
    "MistralForCausalLM": LLAMA_PACKED_MODULES,
    "Qwen2ForCausalLM": LLAMA_PACKED_MODULES,
    "Qwen3ForCausalLM": LLAMA_PACKED_MODULES,
    "Qwen3MoeForCausalLM": ATTENTION_ONLY,
    "MixtralForCausalLM": ATTENTION_ONLY,
    "GptOssForCausalLM": ATTENTION_ONLY,
    "DeepseekV3ForCausalLM": MLP_ONLY,
}
"""vLLM 0.32.0's ``packed_modules_mapping`` of each model class (``vllm.model_executor.models``)."""

# vLLM's parallel linear classes: QKVParallelLinear and MergedColumnParallelLinear split the
# outputs (column), RowParallelLinear the inputs (row). Other names: qscheme's default TP plan.
_EXPERT = re.compile(r"^(?P<layer>(?:.+\.)?experts)\.(?P<index>[0-9]+)\.(?P<projection>[A-Za-z0-9_]+)$")

LayerKind = Literal["linear", "fused_moe"]

EXPERT_FUSED: PackedModules = {"gate_up_proj": ("gate_proj", "up_proj")}
"""vLLM's fused-MoE layer holds each expert's gate and up projections as one ``w13`` (gate ``w1``
first, up ``w3``), and down as ``w2``; the plugin's MoE method runs gate and up as one fused
layer per expert, each keeping its own global scale."""


def packed_modules_for(architectures: Sequence[str] | None) -> PackedModules:
    """The mapping of the first listed architecture vLLM's table has; Llama's otherwise."""
    for name in architectures or ():
        if name in PACKED_MODULES:
            return PACKED_MODULES[name]
    return LLAMA_PACKED_MODULES


def fused_members(prefix: str, mapping: PackedModules | None) -> list[str]:
    """The checkpoint modules behind vLLM's layer ``prefix``: ``model.layers.0.self_attn.qkv_proj``
    -> its ``q_proj``, ``k_proj``, ``v_proj``; a layer vLLM does not fuse is its own module."""
    parent, _, last = prefix.rpartition(".")
    members = (mapping or {}).get(last)
    if members:
        return [f"{parent}.{member}" if parent else member for member in members]
    return [prefix]


def expert_of(module: str) -> tuple[str, int, str] | None:
    """``model.layers.0.mlp.experts.3.down_proj`` -> (``model.layers.0.mlp.experts``, 3,
    ``down_proj``); None for a module that is no expert's projection."""
    match = _EXPERT.match(module)
    if match is None:
        return None
    return match["layer"], int(match["index"]), match["projection"]


@dataclass(frozen=True)
class VllmLayer:
    """One layer vLLM builds and the checkpoint modules it loads, in vLLM's order (the fused
    members' order along N; experts by index, then projection in checkpoint order)."""

    name: str
    kind: LayerKind
    members: tuple[str, ...]

    @property
    def fused(self) -> bool:
        return len(self.members) > 1

    @property
    def short_name(self) -> str:
        return self.name.rpartition(".")[2]


def vllm_layers(modules: Iterable[str], mapping: PackedModules | None = None) -> list[VllmLayer]:
    """The vLLM layers that hold ``modules`` (a checkpoint's quantized modules), in the order of
    each layer's first module. A fused layer lists all its members (as ``fused_members`` gives
    them), whether or not the checkpoint has each: the plugin refuses a partly quantized one."""
    mapping = LLAMA_PACKED_MODULES if mapping is None else mapping
    member_of: dict[str, str] = {member: fused for fused, members in mapping.items() for member in members}
    layers: dict[str, VllmLayer] = {}
    experts: dict[str, list[tuple[int, int, str]]] = {}
    for order, module in enumerate(modules):
        expert = expert_of(module)
        if expert is not None:
            name, index, _ = expert
            experts.setdefault(name, []).append((index, order, module))
            layers.setdefault(name, VllmLayer(name, "fused_moe", ()))
            continue
        parent, _, last = module.rpartition(".")
        fused = member_of.get(last)
        name = module if fused is None else (f"{parent}.{fused}" if parent else fused)
        if name not in layers:
            layers[name] = VllmLayer(name, "linear", tuple(fused_members(name, mapping)))
    for name, found in experts.items():
        layers[name] = VllmLayer(name, "fused_moe", tuple(module for _, _, module in sorted(found)))
    return list(layers.values())
