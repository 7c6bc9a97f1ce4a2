"""Put a checkpoint's quantized layers into a transformers model that is still on the meta device.

transformers builds the model on the meta device, lets the quantizer change it, loads the
checkpoint's tensors into whatever parameters the model has, materialises what was not loaded
(``torch.empty_like``) and finally hands the model back to the quantizer.

``plan_swap`` runs before the weights load: it plans the checkpoint (config and headers only),
checks every quantized module against the model's (an ``nn.Linear`` of the same shape and bias,
or an expert projection of a fused experts module, every expert of which must be quantized)
and puts a ``PendingLayer`` (no parameters, no buffers) in place of each, so transformers neither
allocates float weights for them nor overwrites what qscheme loads. A fused experts module's
checkpoint tensors (``experts.<e>.gate_proj...``) then match no parameter of the model, so
transformers' weight-conversion mapping (which merges them into ``gate_up_proj``) never reads
them. ``Swap.load`` runs after: it reads the quantized tensors one
module at a time, straight into each ``QuantLinear``'s canonical buffers, and replaces the
placeholders. No float copy of a quantized weight is ever made. ``taken_key_patterns`` tells
transformers which checkpoint keys qscheme reads itself (so that they are not reported as
unexpected).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qscheme.checkpoint.load import check_module_values
from qscheme.checkpoint.plan import Plan, format_problems, plan_checkpoint
from qscheme.checkpoint.routers import router_hint
from qscheme.descriptor import Scheme
from qscheme.errors import CheckpointError, UsageError
from qscheme.modules import ExpertsSpec, QuantExperts, QuantLinear, find_expert_modules
from qscheme.modules.experts import gating_of

Gate = Callable[[torch.Tensor], torch.Tensor]


class PendingLayer(torch.nn.Module):
    """Stands where a quantized layer (or experts module) will be once its tensors are read."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.layer_name = name

    def forward(self, *args: object, **kwargs: object) -> None:
        raise UsageError(
            f"{self.layer_name}: this quantized layer was never loaded (from_pretrained did not finish); load the "
            "model again"
        )

    def extra_repr(self) -> str:
        return self.layer_name


@contextmanager
def _plain_tensor_creation() -> Iterator[None]:
    """Undo transformers' model-init context (meta default device, the model's default dtype)
    while qscheme builds layers: canonical tensors are real, and their dtypes are the scheme's."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device("cpu"):
            yield
    finally:
        torch.set_default_dtype(dtype)


def _owner(name: str, specs: dict[str, ExpertsSpec]) -> ExpertsSpec | None:
    for spec in specs.values():
        if spec.split(name) is not None:
            return spec
    return None


def _check_linear(model: torch.nn.Module, name: str, n: int, k: int, has_bias: bool, folder: Path) -> None:
    try:
        target = model.get_submodule(name)
    except AttributeError:
        raise CheckpointError(
            f"{folder}: the checkpoint quantizes {name!r}, which the model ({type(model).__name__}) does not have; "
            "is config.json the checkpoint's own?"
        ) from None
    if not isinstance(target, torch.nn.Linear):
        raise CheckpointError(
            f"{folder}: the checkpoint quantizes {name!r}, but the model's module there is a {type(target).__name__}, "
            "not an nn.Linear; qscheme replaces nn.Linear modules and fused experts only"
            + router_hint(name, type(target).__name__)
        )
    if (target.out_features, target.in_features) != (n, k):
        raise CheckpointError(
            f"{folder}: {name!r} is [{n}, {k}] in the checkpoint but the model's Linear is "
            f"[{target.out_features}, {target.in_features}]; is config.json the checkpoint's own?"
        )
    if (target.bias is not None) != has_bias:
        raise CheckpointError(
            f"{folder}: {name!r}: the model's Linear {'has' if target.bias is not None else 'has no'} bias but the "
            "checkpoint disagrees"
        )


def _refuse_tied_quantized(model: torch.nn.Module, quantized: set[str], folder: Path) -> None:
    """A quantized lm_head cannot share the embedding's weight (which stays a float table)."""
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    if not getattr(text_config, "tie_word_embeddings", False):
        return
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    if output is None:
        return
    name = next((n for n, module in model.named_modules() if module is output), None)
    if name in quantized:
        raise CheckpointError(
            f"{folder}: the checkpoint quantizes {name!r}, but config.json ties it to the input embeddings "
            "(tie_word_embeddings: true); a quantized output layer cannot share the embedding's float weight. "
            "Set tie_word_embeddings to false in config.json (the checkpoint then needs its own embedding tensor), "
            "or leave the output layer unquantized"
        )


def _require_every_expert(spec: ExpertsSpec, members: Sequence[str], folder: Path) -> None:
    """CheckpointError, before anything loads, when the checkpoint lacks some expert projections
    of a fused experts module or has experts the model does not (QuantExperts checks the same
    again as it is filled)."""
    module, count = spec.module, spec.num_experts
    present: dict[int, set[str]] = {}
    for name in members:
        parsed = spec.split(name)
        assert parsed is not None  # members are the names _owner gave this spec
        index, projection = parsed
        if index >= count:
            raise CheckpointError(
                f"{folder}: the checkpoint quantizes {name!r}, but the model's {module} has {count} experts "
                f"(0..{count - 1}); is config.json the checkpoint's own?"
            )
        present.setdefault(index, set()).add(projection)
    missing: list[str] = []
    for index in range(count):
        have = present.get(index, set())
        needed = ["down_proj"] if "gate_up_proj" in have else ["gate_proj", "up_proj", "down_proj"]
        missing.extend(f"{module}.{index}.{projection}" for projection in needed if projection not in have)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(
            f"{folder}: {module}: {len(missing)} of the model's expert projections have no quantized layer in the "
            f"checkpoint: {shown}. Every expert must be quantized in one checkpoint; a checkpoint that leaves some "
            "experts unquantized must list them all in its ignore list, so that they load through the model's own "
            "fused parameters"
        )


def _bias_names(plan: Plan) -> set[str]:
    return {name[: -len(".bias")] for name in plan.files.tensors if name.endswith(".bias")}


def _set(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


@dataclass
class Swap:
    """A checked plan of which modules of a model become quantized layers (``plan_swap``)."""

    plan: Plan
    device: torch.device | str
    activation_dtype: str | torch.dtype
    kernel: str | None
    specs: dict[str, ExpertsSpec]  # fused experts module -> its spec
    experts: dict[str, list[str]]  # fused experts module -> its checkpoint modules
    linears: list[str]  # checkpoint modules that replace an nn.Linear
    gatings: dict[str, tuple[Gate | None, Gate | None]] = field(default_factory=dict)  # (act_fn, _apply_gate)
    dequantized: list[str] = field(default_factory=list)  # quantized modules whose float weight the model keeps
    kernels: dict[str, str] = field(default_factory=dict)  # filled by load: layer -> kernel name

    @property
    def folder(self) -> Path:
        return self.plan.path

    def taken_key_patterns(self) -> list[str]:
        """Regexes matching the checkpoint keys qscheme reads itself: every tensor of a quantized
        module (bias included) and of a replaced experts module."""
        prefixes = [re.escape(name) for name in (*self.experts, *self.linears)]
        return [rf"^(?:{'|'.join(prefixes)})\."] if prefixes else []

    def load(self, model: torch.nn.Module) -> None:
        """Read every quantized module's tensors into its QuantLinear and put the layers (and the
        QuantExperts holding expert layers) where the placeholders are."""
        experts = {
            name: QuantExperts.empty(self.specs[name], self.gatings[name][0], apply_gate=self.gatings[name][1])
            for name in self.experts
        }
        owner_of = {member: module for module, members in self.experts.items() for member in members}
        with _plain_tensor_creation(), torch.no_grad():
            for name, layout in self.plan.layouts.items():
                if name in self.dequantized:
                    continue
                biases: dict[str, torch.Tensor] = {}
                weight, problems = check_module_values(self.plan, layout, biases)
                if weight is None:
                    raise CheckpointError(f"{self.folder}: {name}: nothing was loaded:\n{format_problems(problems)}")
                layer = QuantLinear.from_canonical(
                    weight,
                    device=self.device,
                    kernel=self.kernel,
                    bias=biases.get(name),
                    layer_name=name,
                    activation_dtype=self.activation_dtype,
                )
                owner = owner_of.get(name)
                if owner is None:
                    _set(model, name, layer)
                else:
                    relative = name[len(owner) + 1 :]
                    experts[owner].set_layer(relative, layer)
                self.kernels[name] = layer.kernel.name
        for name, module in experts.items():
            module.require_complete()
            _set(model, name, module)


def plan_swap(
    model: torch.nn.Module,
    folder: str | Path,
    *,
    schemes: Sequence[Scheme] | None = None,
    device: torch.device | str = "cpu",
    activation_dtype: str | torch.dtype = "bfloat16",
    kernel: str | None = None,
    dequantize_non_linear: bool = False,
) -> Swap:
    """Check the checkpoint in ``folder`` against ``model`` (on the meta device or not) and put a
    PendingLayer where each quantized module (``nn.Linear`` or fused experts module) is.

    Everything is checked before the model is changed; a problem raises CheckpointError. No
    tensor data is read (``Swap.load`` reads it). ``dequantize_non_linear``: a quantized module
    whose model module is an ``nn.Embedding`` of the same shape (a GGUF's quantized token
    embedding) is left in place and listed in ``Swap.dequantized``: its float weight comes through
    the state dict the caller gives transformers.
    """
    folder = Path(folder)
    with _plain_tensor_creation():  # it reads the small weight_shape tensors
        plan = plan_checkpoint(folder, schemes=schemes)
    if plan.problems:
        raise CheckpointError(
            f"{folder}: {len(plan.problems)} problem(s) found, nothing was loaded:\n{format_problems(plan.problems)}"
        )
    if not plan.layouts:
        raise CheckpointError(
            f"{folder}: the checkpoint has no quantized module qscheme recognises; run `qscheme inspect {folder}` "
            "to see what was detected"
        )
    _refuse_tied_quantized(model, set(plan.layouts), folder)
    specs = find_expert_modules(model)
    with_bias = _bias_names(plan)
    experts: dict[str, list[str]] = {}
    linears: list[str] = []
    dequantized: list[str] = []
    for name, layout in plan.layouts.items():
        spec = _owner(name, specs)
        if spec is None and dequantize_non_linear and _float_table(model, name, layout.n, layout.k):
            dequantized.append(name)
            continue
        if spec is None:
            _check_linear(model, name, layout.n, layout.k, name in with_bias, folder)
            linears.append(name)
            continue
        if spec.problem is not None:
            raise CheckpointError(f"{folder}: the checkpoint quantizes {name!r}, but {spec.module}: {spec.problem}")
        experts.setdefault(spec.module, []).append(name)
    for module_name, members in experts.items():
        _require_every_expert(specs[module_name], members, folder)
    gatings = {}
    for module_name in experts:
        act_fn, apply_gate = gating_of(model.get_submodule(module_name))
        if act_fn is None and apply_gate is None:
            raise CheckpointError(
                f"{folder}: the fused experts module {module_name!r} has neither an act_fn nor an _apply_gate"
            )
        gatings[module_name] = (act_fn, apply_gate)
    for name in (*linears, *experts):
        _set(model, name, PendingLayer(name))
    return Swap(plan, device, activation_dtype, kernel, specs, experts, linears, gatings, dequantized=dequantized)


def _float_table(model: torch.nn.Module, name: str, n: int, k: int) -> bool:
    """Whether the model's module ``name`` is an nn.Embedding of an [n, k] weight."""
    try:
        target = model.get_submodule(name)
    except AttributeError:
        return False
    weight = getattr(target, "weight", None)
    return (
        not isinstance(target, torch.nn.Linear) and isinstance(weight, torch.Tensor) and tuple(weight.shape) == (n, k)
    )
