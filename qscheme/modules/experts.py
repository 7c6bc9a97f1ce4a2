"""QuantExperts: quantized mixture-of-experts layers for transformers 5's fused experts modules.

transformers 5 stores a MoE block's experts as two 3-D parameters (Qwen3-MoE:
``gate_up_proj`` [E, 2I, H], gate rows first, and ``down_proj`` [E, H, I]) and runs them in one
``forward(hidden_states, top_k_index, top_k_weights)``. Quantized checkpoints (compressed-tensors,
ModelOpt) keep one linear per expert and projection: ``<experts>.<e>.gate_proj``, ``up_proj``,
``down_proj``. ``QuantExperts`` holds those as ``QuantLinear`` layers under the very same names
(``model.get_submodule("...mlp.experts.3.down_proj")`` is the layer of checkpoint module
``...mlp.experts.3.down_proj``), so every kernel is resolved, reported and run as any layer's.

Its forward has the routing semantics of the module it replaces: each token is sent to its
``top_k_index`` experts, each expert computes ``down(act(gate(x)) * up(x))`` and the results are
summed weighted by ``top_k_weights``; an index equal to the number of experts (expert-parallel
padding) is skipped, as transformers skips it. A checkpoint loaded with
``fuse={"gate_up_proj": ["gate_proj", "up_proj"]}`` gives each expert one fused ``gate_up_proj``
layer instead (gate rows first, as transformers' own fused parameter).

The module's own layout flags (transformers' ``use_experts_implementation``) are followed, not
refused: gate and up rows interleaved (``is_concatenated=False``: gate rows even, up rows odd, as
gpt-oss stores them), experts with biases (``has_bias``: every expert layer must then carry its
bias) and weights held transposed (``is_transposed``: [E, H, 2I], only the layout ``dequantized``
returns). The gating is the module's own ``_apply_gate`` on the fused gate/up output in the
module's row order where it has one (gpt-oss's clamped SwiGLU), else ``act_fn(gate) * up``.

``find_expert_modules`` tells which modules of a model are fused experts; ``apply_to_model`` and
the transformers quantizers (``qscheme.transformers``) build a QuantExperts for each, from a loaded
checkpoint (``from_checkpoint``) or empty (``empty``) and then from tensors (``load_tensors``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from qscheme.descriptor import Scheme
from qscheme.errors import CheckpointError, UsageError
from qscheme.modules.linear import QuantLinear

PROJECTIONS: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
FUSED_GATE_UP = "gate_up_proj"
GATE_UP_FUSE: dict[str, list[str]] = {FUSED_GATE_UP: ["gate_proj", "up_proj"]}


@dataclass(frozen=True)
class ExpertsSpec:
    """One fused experts module of a model, and the per-expert checkpoint modules it stands for.

    ``module`` is its name in the model and the prefix of its checkpoint modules
    (``<module>.<e>.<projection>``). ``problem`` is None for a layout QuantExperts can run, else
    why it cannot (no gate, shapes that are not experts). ``interleaved``: gate and up rows
    alternate (gate even, up odd) instead of gate rows first; ``has_bias``: every projection has a
    bias; ``transposed``: the module holds its weights as [E, K, N].
    """

    module: str
    module_type: str
    num_experts: int
    hidden_size: int
    intermediate_size: int
    problem: str | None = None
    interleaved: bool = False
    has_bias: bool = False
    transposed: bool = False

    @property
    def checkpoint_prefix(self) -> str:
        return f"{self.module}."

    def layer_names(self) -> list[str]:
        """The checkpoint module names of every expert's projections, expert by expert."""
        return [f"{self.module}.{e}.{p}" for e in range(self.num_experts) for p in PROJECTIONS]

    def shape(self, projection: str) -> tuple[int, int]:
        """[N, K] of one expert's ``projection`` (gate_proj, up_proj, down_proj or gate_up_proj)."""
        hidden, inner = self.hidden_size, self.intermediate_size
        shapes = {"gate_proj": (inner, hidden), "up_proj": (inner, hidden), "down_proj": (hidden, inner)}
        shapes[FUSED_GATE_UP] = (2 * inner, hidden)
        if projection not in shapes:
            raise UsageError(
                f"{self.module}: {projection!r} is not an expert projection; use one of {', '.join(shapes)}"
            )
        return shapes[projection]

    def split(self, name: str) -> tuple[int, str] | None:
        """(expert index, projection) for a checkpoint module ``<module>.<e>.<projection>``; else None."""
        if not name.startswith(self.checkpoint_prefix):
            return None
        index, _, projection = name[len(self.checkpoint_prefix) :].partition(".")
        if not index.isdigit() or projection not in (*PROJECTIONS, FUSED_GATE_UP):
            return None
        return int(index), projection


def _has_bias(module: torch.nn.Module) -> bool:
    return bool(getattr(module, "has_bias", False)) or any(
        getattr(module, name, None) is not None for name in ("gate_up_proj_bias", "down_proj_bias")
    )


def _layout_problem(module: torch.nn.Module, gate_up: Tensor, down: Tensor, transposed: bool) -> str | None:
    """Why a fused experts module's layout is not one QuantExperts runs (None when it is)."""
    if not getattr(module, "has_gate", True):
        return "its experts have no gate; QuantExperts runs gated (gate, up, down) experts"
    if transposed:
        experts, hidden, rows = gate_up.shape
        wanted, layout = (experts, rows // 2, hidden), "[E, H, 2I] and [E, I, H] (transposed)"
    else:
        experts, rows, hidden = gate_up.shape
        wanted, layout = (experts, hidden, rows // 2), "[E, 2I, H] and [E, H, I]"
    if rows % 2 or tuple(down.shape) != wanted:
        return f"gate_up_proj {list(gate_up.shape)} and down_proj {list(down.shape)} are not {layout}"
    act_fn, apply_gate = gating_of(module)
    if act_fn is None and apply_gate is None:
        return "it has neither an act_fn nor an _apply_gate"
    return None


def gating_of(
    module: torch.nn.Module,
) -> tuple[Callable[[Tensor], Tensor] | None, Callable[[Tensor], Tensor] | None]:
    """(act_fn, _apply_gate) of a fused experts module, each None where it has none. ``_apply_gate``
    (transformers' hook, gpt-oss's clamped SwiGLU) takes the fused gate/up output in the module's
    row order and returns the gated intermediate."""
    act_fn = getattr(module, "act_fn", None)
    apply_gate = getattr(module, "_apply_gate", None)
    return (act_fn if callable(act_fn) else None), (apply_gate if callable(apply_gate) else None)


def find_expert_modules(model: torch.nn.Module) -> dict[str, ExpertsSpec]:
    """Every fused experts module of ``model`` (3-D ``gate_up_proj`` and ``down_proj``
    parameters, as transformers 5's MoE models hold them), by module name, in model order.

    Works on a model on the meta device (only shapes are read). Modules already replaced by a
    QuantExperts are not listed.
    """
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"find_expert_modules: model must be a torch.nn.Module, not {type(model).__name__}")
    found: dict[str, ExpertsSpec] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantExperts):
            continue
        gate_up = module._parameters.get("gate_up_proj")
        down = module._parameters.get("down_proj")
        if not isinstance(gate_up, Tensor) or not isinstance(down, Tensor) or gate_up.dim() != 3 or down.dim() != 3:
            continue
        transposed = bool(getattr(module, "is_transposed", False))
        experts, rows, hidden = gate_up.shape
        if transposed:
            experts, hidden, rows = gate_up.shape
        found[name] = ExpertsSpec(
            module=name,
            module_type=type(module).__name__,
            num_experts=int(experts),
            hidden_size=int(hidden),
            intermediate_size=int(rows) // 2,
            problem=_layout_problem(module, gate_up, down, transposed),
            interleaved=not getattr(module, "is_concatenated", True),
            has_bias=_has_bias(module),
            transposed=transposed,
        )
    return found


class Expert(torch.nn.Module):
    """One expert's quantized projections: ``gate_proj``, ``up_proj`` and ``down_proj``, or a fused
    ``gate_up_proj`` (gate rows first) and ``down_proj``. Unset projections are None."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj: QuantLinear | None = None
        self.up_proj: QuantLinear | None = None
        self.gate_up_proj: QuantLinear | None = None
        self.down_proj: QuantLinear | None = None

    def missing(self) -> list[str]:
        """The projections this expert still lacks."""
        gate_up = ["gate_proj", "up_proj"] if self.gate_up_proj is None else []
        absent = [name for name in gate_up if getattr(self, name) is None]
        if self.down_proj is None:
            absent.append("down_proj")
        return absent

    def gate_up(self, x: Tensor, interleaved: bool) -> Tensor:
        """The fused gate/up output, rows in the module's order (gate first, or interleaved)."""
        if self.gate_up_proj is not None:
            out: Tensor = self.gate_up_proj(x)
            return out
        assert self.gate_proj is not None and self.up_proj is not None  # require_complete ran
        return _fused_rows(self.gate_proj(x), self.up_proj(x), interleaved)

    def forward(self, x: Tensor, gate: Callable[[Tensor], Tensor], interleaved: bool = False) -> Tensor:
        """``down(gate(gate_up(x)))``; ``gate`` takes the fused gate/up output (see ``QuantExperts.gate``)."""
        assert self.down_proj is not None
        out: Tensor = self.down_proj(gate(self.gate_up(x, interleaved)))
        return out


def _fused_rows(gate: Tensor, up: Tensor, interleaved: bool) -> Tensor:
    """gate and up along the last dimension: gate first, or alternating (gate even, up odd)."""
    if interleaved:
        return torch.stack([gate, up], dim=-1).flatten(-2)
    return torch.cat([gate, up], dim=-1)


class QuantExperts(torch.nn.Module):
    """Quantized experts with the forward of transformers 5's fused experts modules.

    Child modules are named as the checkpoint's per-expert modules: ``<e>.gate_proj`` etc.
    (see the module docstring).
    """

    def __init__(
        self,
        spec: ExpertsSpec,
        act_fn: Callable[[Tensor], Tensor] | None,
        *,
        apply_gate: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        super().__init__()
        if spec.problem is not None:
            raise UsageError(f"{spec.module} ({spec.module_type}): {spec.problem}; it cannot become a QuantExperts")
        if act_fn is None and apply_gate is None:
            raise UsageError(f"{spec.module} ({spec.module_type}): give its act_fn or its _apply_gate")
        self.spec = spec
        self.num_experts = spec.num_experts
        self.hidden_dim = spec.hidden_size
        self.intermediate_dim = spec.intermediate_size
        self.act_fn = act_fn
        self.apply_gate = apply_gate
        for index in range(spec.num_experts):
            self.add_module(str(index), Expert())

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def empty(
        cls,
        spec: ExpertsSpec,
        act_fn: Callable[[Tensor], Tensor] | None,
        *,
        apply_gate: Callable[[Tensor], Tensor] | None = None,
    ) -> QuantExperts:
        """A QuantExperts with no layers yet (no memory: build it on any device, even inside
        ``torch.device("meta")``); fill it with ``load_tensors`` or ``set_layer``."""
        return cls(spec, act_fn, apply_gate=apply_gate)

    @classmethod
    def from_module(cls, module: torch.nn.Module, spec: ExpertsSpec) -> QuantExperts:
        """An empty QuantExperts for the fused experts ``module`` (its gating, its spec)."""
        act_fn, apply_gate = gating_of(module)
        if act_fn is None and apply_gate is None:
            raise UsageError(
                f"{spec.module} ({type(module).__name__}) has neither an act_fn nor an _apply_gate; it is not a fused "
                "experts module"
            )
        return cls(spec, act_fn, apply_gate=apply_gate)

    @classmethod
    def from_checkpoint(
        cls,
        spec: ExpertsSpec,
        layers: Mapping[str, QuantLinear],
        act_fn: Callable[[Tensor], Tensor] | None,
        *,
        apply_gate: Callable[[Tensor], Tensor] | None = None,
    ) -> QuantExperts:
        """A complete QuantExperts from loaded layers keyed by checkpoint module name (a
        ``Checkpoint``, or any mapping): ``<spec.module>.<e>.gate_proj`` ... for every expert.

        Raises CheckpointError naming what is missing or of the wrong shape.
        """
        experts = cls(spec, act_fn, apply_gate=apply_gate)
        for name, layer in layers.items():
            if spec.split(name) is not None:
                experts.set_layer(name[len(spec.checkpoint_prefix) :], layer)
        experts.require_complete()
        return experts

    def set_layer(self, name: str, layer: QuantLinear) -> None:
        """Put ``layer`` at ``"<e>.<projection>"`` (relative to this module), checking its shape."""
        parsed = self.spec.split(self.spec.checkpoint_prefix + name)
        if parsed is None:
            raise CheckpointError(
                f"{self.spec.module}.{name}: not an expert projection; expert layers are named "
                f"<e>.gate_proj, <e>.up_proj, <e>.down_proj (or <e>.gate_up_proj) for e < {self.num_experts}"
            )
        index, projection = parsed
        if index >= self.num_experts:
            raise CheckpointError(
                f"{self.spec.module}.{name}: expert {index} does not exist; the model's {self.spec.module_type} has "
                f"{self.num_experts} experts (0..{self.num_experts - 1}): build the model from the checkpoint's config"
            )
        if not isinstance(layer, QuantLinear):
            raise UsageError(f"{self.spec.module}.{name}: expected a QuantLinear, got {type(layer).__name__}")
        expected = self.spec.shape(projection)
        if (layer.out_features, layer.in_features) != expected:
            raise CheckpointError(
                f"{self.spec.module}.{name}: the checkpoint's weight is [{layer.out_features}, {layer.in_features}] "
                f"but the model's experts (hidden size {self.hidden_dim}, intermediate size "
                f"{self.intermediate_dim}) need [{expected[0]}, {expected[1]}]; build the model from the checkpoint's "
                "config.json"
            )
        if layer.bias is not None and not self.spec.has_bias:
            raise CheckpointError(
                f"{self.spec.module}.{name}: the checkpoint has a bias; the model's experts have none"
            )
        if layer.bias is None and self.spec.has_bias:
            raise CheckpointError(
                f"{self.spec.module}.{name}: the model's experts ({self.spec.module_type}) have biases but the "
                "checkpoint gives this expert layer none; it would run without its bias: restore the checkpoint's "
                "bias tensors (e.g. <experts>.gate_up_proj_bias), or re-export the checkpoint"
            )
        expert = self.expert(index)
        if projection == FUSED_GATE_UP and (expert.gate_proj is not None or expert.up_proj is not None):
            raise CheckpointError(f"{self.spec.module}.{index}: both gate_up_proj and gate_proj/up_proj given")
        if projection in ("gate_proj", "up_proj") and expert.gate_up_proj is not None:
            raise CheckpointError(f"{self.spec.module}.{index}: both gate_up_proj and {projection} given")
        setattr(expert, projection, layer)

    def load_tensors(
        self,
        scheme: Scheme | str | Path,
        tensors: Mapping[str, Tensor],
        *,
        device: torch.device | str = "cpu",
        kernel: str | None = None,
        activation_dtype: str | torch.dtype = "bfloat16",
    ) -> None:
        """Build the layers from checkpoint tensors of one scheme, keyed ``"<e>.<projection>.<tensor>"``
        (relative to this module: ``"0.gate_proj.weight_packed"``) or by their full names.

        Each layer gets ``QuantLinear.from_tensors``'s checks; the tensors are kept, not copied.
        Layers not among ``tensors`` are left as they were: call ``require_complete`` when done.
        """
        by_layer: dict[str, dict[str, Tensor]] = {}
        for key, value in tensors.items():
            relative = key[len(self.spec.checkpoint_prefix) :] if key.startswith(self.spec.checkpoint_prefix) else key
            layer, _, tensor = relative.rpartition(".")
            if not layer:
                raise CheckpointError(
                    f"{self.spec.module}: tensor {key!r} is not named <e>.<projection>.<tensor> "
                    "(e.g. '0.gate_proj.weight_packed')"
                )
            by_layer.setdefault(layer, {})[tensor] = value
        for layer, members in by_layer.items():
            full = f"{self.spec.module}.{layer}"
            if self.spec.split(full) is None:
                raise CheckpointError(
                    f"{self.spec.module}: tensors {sorted(members)} belong to {layer!r}, which is not an expert "
                    f"projection (<e>.gate_proj, <e>.up_proj, <e>.down_proj or <e>.gate_up_proj)"
                )
            built = QuantLinear.from_tensors(
                scheme, members, device=device, kernel=kernel, layer_name=full, activation_dtype=activation_dtype
            )
            self.set_layer(layer, built)

    def require_complete(self) -> None:
        """CheckpointError naming the expert projections that have no layer yet."""
        missing = [
            f"{self.spec.module}.{index}.{name}"
            for index in range(self.num_experts)
            for name in self.expert(index).missing()
        ]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise CheckpointError(
                f"{self.spec.module}: {len(missing)} of the model's expert projections have no quantized layer in the "
                f"checkpoint: {shown}. Every expert must be quantized in one checkpoint; a checkpoint that leaves some "
                "experts unquantized loads through the model's own fused parameters instead"
            )

    # -- access --------------------------------------------------------------------------------

    def expert(self, index: int) -> Expert:
        module = self._modules[str(index)]
        assert isinstance(module, Expert)
        return module

    def layers(self) -> Iterator[tuple[str, QuantLinear]]:
        """(checkpoint module name, layer) for every loaded layer, expert by expert."""
        for index in range(self.num_experts):
            expert = self.expert(index)
            for name in ("gate_proj", "up_proj", FUSED_GATE_UP, "down_proj"):
                layer = getattr(expert, name)
                if layer is not None:
                    yield f"{self.spec.module}.{index}.{name}", layer

    def dequantized(self) -> tuple[Tensor, Tensor]:
        """float32 (gate_up_proj [E, 2I, H], down_proj [E, H, I]; [E, H, 2I] and [E, I, H] for a
        transposed module): the fused parameters this module encodes (each layer's
        ``effective_weight``), in the layout and row order of the module it replaced."""
        self.require_complete()
        gate_up, down = [], []
        for index in range(self.num_experts):
            expert = self.expert(index)
            if expert.gate_up_proj is not None:
                gate_up.append(expert.gate_up_proj.effective_weight())
            else:
                assert expert.gate_proj is not None and expert.up_proj is not None
                rows = _fused_rows(
                    expert.gate_proj.effective_weight().T, expert.up_proj.effective_weight().T, self.spec.interleaved
                )
                gate_up.append(rows.T)
            assert expert.down_proj is not None
            down.append(expert.down_proj.effective_weight())
        if self.spec.transposed:
            return torch.stack(gate_up).transpose(1, 2), torch.stack(down).transpose(1, 2)
        return torch.stack(gate_up), torch.stack(down)

    def gate(self, gate_up: Tensor) -> Tensor:
        """The gated intermediate from the fused gate/up output (rows in the module's order): the
        module's own ``_apply_gate`` where it had one, else ``act_fn(gate) * up``."""
        if self.apply_gate is not None:
            return self.apply_gate(gate_up)
        assert self.act_fn is not None  # __init__ requires one of the two
        if self.spec.interleaved:
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        else:
            gate, up = gate_up.chunk(2, dim=-1)
        out: Tensor = self.act_fn(gate) * up
        return out

    # -- computation ---------------------------------------------------------------------------

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """[T, H] tokens routed to their ``top_k_index`` [T, k] experts, weighted by
        ``top_k_weights`` [T, k]; returns [T, H] in the tokens' dtype."""
        if hidden_states.dim() != 2 or hidden_states.shape[-1] != self.hidden_dim:
            raise UsageError(
                f"{self.spec.module}: hidden_states must be [tokens, {self.hidden_dim}], "
                f"got {list(hidden_states.shape)}"
            )
        if top_k_index.shape != top_k_weights.shape or top_k_index.shape[:1] != hidden_states.shape[:1]:
            raise UsageError(
                f"{self.spec.module}: top_k_index {list(top_k_index.shape)} and top_k_weights "
                f"{list(top_k_weights.shape)} must both be [tokens, top_k] for {hidden_states.shape[0]} tokens"
            )
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            # one extra class: an index equal to num_experts is expert-parallel padding, skipped
            mask = torch.nn.functional.one_hot(top_k_index.long(), num_classes=self.num_experts + 1)
            mask = mask.permute(2, 1, 0)  # [experts + 1, top_k, tokens]
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for row in hit:
            index = int(row[0])
            if index >= self.num_experts:
                continue
            position, token = torch.where(mask[index])
            out = self.expert(index)(hidden_states[token], self.gate, self.spec.interleaved)
            out = out * top_k_weights[token, position, None]
            final.index_add_(0, token, out.to(final.dtype))
        return final

    def extra_repr(self) -> str:
        kernels = sorted({layer.kernel.name for _, layer in self.layers()})
        schemes = sorted({layer.scheme.name for _, layer in self.layers()})
        return (
            f"num_experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
            f"scheme={','.join(schemes) or 'none'}, kernel={','.join(kernels) or 'none'}"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"
