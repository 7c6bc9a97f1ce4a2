"""``apply_to_model``: put a checkpoint into a torch model built from its config.

Every quantized module of the checkpoint replaces the model's ``nn.Linear`` of the same name
(shapes and bias must agree); every plain tensor is loaded into the model's state dict. Strict by
default: a checkpoint module or tensor the model lacks, or a model parameter the checkpoint
does not provide, raises CheckpointError (tied weights, such as an lm_head tied to the
embeddings, count as provided). With ``strict=False`` those are skipped instead: the
checkpoint's extra modules and tensors are left out, the model keeps its own values for what
the checkpoint does not provide, and the report's notes list both. A module or tensor that both
have but that disagree (type, shape, bias) raises either way.

A quantized layer whose model module is an ``nn.Embedding`` of its shape (a GGUF file's quantized
``token_embd``) is dequantized exactly into the embedding's weight, cast to the model's dtype (the
float32 weight is held once while it is copied): an embedding is a lookup, not a matmul. Any other
module that is not an ``nn.Linear`` (a MoE router) is refused, naming the fix.

Fused MoE experts (transformers 5's experts modules with 3-D ``gate_up_proj`` / ``down_proj``
parameters, ``qscheme.modules.experts``) take the checkpoint's per-expert layers
(``<experts>.<e>.gate_proj`` ...): a module whose experts the checkpoint quantizes becomes a
``QuantExperts`` holding every one of them (an expert missing raises); one whose experts the
checkpoint stores unquantized gets their weights stacked into its fused parameters.

Everything is checked before the model is changed: when apply_to_model raises, the model is
left exactly as it was, never half-converted.

One pipeline serves a single process and a tensor-parallel rank (``apply_to_model_tp``): check
the model, load, match the quantized layers, match the plain tensors, then change the model. The
split is its parameter: ``WholeModel`` (a single process, the degenerate split: whole layers,
MoE experts) or ``qscheme.parallel.model.RankSplit`` (the rank's shards, wrapped to communicate,
see that module).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from qscheme.api_checks import require_flag
from qscheme.checkpoint.load import (
    Checkpoint,
    FusePolicyChoice,
    ShardedCheckpoint,
    load_checkpoint,
)
from qscheme.checkpoint.plan import FuseSpec
from qscheme.checkpoint.routers import router_hint
from qscheme.dtype_fallback import warn_dtype_fallbacks
from qscheme.errors import CheckpointError, UsageError
from qscheme.kernels.registry import m_split_override
from qscheme.modules import ExpertsSpec, QuantExperts, QuantLinear, checked_device, find_expert_modules
from qscheme.modules.experts import gating_of
from qscheme.parallel.agree import failures_shared
from qscheme.parallel.model import RankSplit
from qscheme.parallel.plan import checked_tp_plan
from qscheme.parallel.rules import checked_degree
from qscheme.text import listing

_ACTIVATION_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _model_device_and_dtype(model: torch.nn.Module) -> tuple[torch.device, str]:
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.device, _ACTIVATION_DTYPES.get(parameter.dtype, "bfloat16")
    return torch.device("cpu"), "bfloat16"


def _refuse_meta(model: torch.nn.Module) -> None:
    """A model on the meta device has no storage to load into: say how to materialise it."""
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        if tensor.is_meta:
            raise UsageError(
                f"apply_to_model: the model's {name!r} is on the meta device, so nothing can be loaded into it; "
                "build the model on the device instead (e.g. LlamaForCausalLM(config) outside "
                "torch.device('meta')): model.to_empty() would leave the tensors the checkpoint does not hold, "
                "such as rotary inv_freq buffers, uninitialised"
            )


def _listing(names: list[str]) -> str:
    return listing(names, 5, sentence=True)


def _place(model: torch.nn.Module, name: str, layer: QuantLinear, path: Path) -> tuple[torch.nn.Module, str] | None:
    """(parent, attribute) where ``layer`` replaces the model's Linear; None when the model has no such module.

    Raises CheckpointError when the model's module is not an nn.Linear of the layer's shape and bias.
    """
    parent_name, _, child = name.rpartition(".")
    try:
        target = model.get_submodule(name)
        parent = model.get_submodule(parent_name) if parent_name else model
    except AttributeError:
        return None
    if isinstance(target, QuantLinear):
        raise CheckpointError(
            f"{path}: model module {name!r} is already a QuantLinear: apply_to_model was run on this model before; "
            "build a fresh model from the checkpoint's config.json"
        )
    if not isinstance(target, torch.nn.Linear):
        raise CheckpointError(
            f"{path}: model module {name!r} is a {type(target).__name__}, not an nn.Linear: apply_to_model replaces "
            "nn.Linear modules only. A model built from another config: build it from the checkpoint's config.json; "
            "a model whose projections are other module types (e.g. GPT-2's Conv1D): use "
            "qscheme.load_checkpoint(path) and call its layers" + router_hint(name, type(target).__name__)
        )
    if (target.out_features, target.in_features) != (layer.out_features, layer.in_features):
        raise CheckpointError(
            f"{path}: module {name!r}: the model's Linear is [{target.out_features}, {target.in_features}] but the "
            f"checkpoint's weight is [{layer.out_features}, {layer.in_features}]"
        )
    if (target.bias is not None) != (layer.bias is not None):
        raise CheckpointError(
            f"{path}: module {name!r}: the model's Linear {'has' if target.bias is not None else 'has no'} bias "
            "but the checkpoint disagrees"
        )
    return parent, child


def _holds_weight_of(model: torch.nn.Module, name: str, layer: QuantLinear) -> bool:
    """Whether the model's ``name`` is an nn.Embedding whose weight has the layer's [N, K] shape: a
    quantized layer there (a GGUF's quantized token_embd) is dequantized into that weight, in the
    model's dtype."""
    try:
        target = model.get_submodule(name)
    except AttributeError:
        return False
    weight = target._parameters.get("weight")
    return (
        isinstance(target, torch.nn.Embedding)
        and isinstance(weight, torch.Tensor)
        and tuple(weight.shape) == (layer.out_features, layer.in_features)
        and layer.bias is None
    )


def _refuse_tied_conflicts(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], folder: Path) -> None:
    """CheckpointError when the checkpoint holds different values for tensors the model ties
    (one storage, such as an lm_head tied to the embeddings): one of them would be lost."""
    by_storage: dict[tuple[int, int], list[str]] = {}
    for name in state:
        target = expected[name]
        by_storage.setdefault((target.untyped_storage().data_ptr(), int(target.storage_offset())), []).append(name)
    for names in by_storage.values():
        first = state[names[0]]
        for other in names[1:]:
            if not torch.equal(state[other].to(first.device, first.dtype), first):
                raise CheckpointError(
                    f"{folder}: the model ties {names[0]!r} and {other!r} (one tensor), but the checkpoint holds "
                    "different values for them; build the model with untied weights (e.g. "
                    "config.tie_word_embeddings = False) to load both"
                )


def _refuse_unwritable(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """UsageError when a model tensor cannot be written here: an inference tensor outside
    torch.inference_mode (a model built under it)."""
    if torch.is_inference_mode_enabled():
        return
    for name in state:
        if expected[name].is_inference():
            raise UsageError(
                f"apply_to_model: the model's {name!r} is an inference tensor (the model was built under "
                "torch.inference_mode()), which cannot be written outside it; build the model outside "
                "inference_mode, or call apply_to_model inside it"
            )


def _expert_layers(checkpoint: Checkpoint, spec: ExpertsSpec) -> dict[str, QuantLinear]:
    return {name: layer for name, layer in checkpoint.items() if spec.split(name) is not None}


def _build_experts(
    model: torch.nn.Module, checkpoint: Checkpoint, specs: dict[str, ExpertsSpec], folder: Path
) -> tuple[list[tuple[torch.nn.Module, str, QuantExperts]], set[str]]:
    """A QuantExperts for every experts module whose layers the checkpoint quantizes: the swaps,
    and the checkpoint layers they take."""
    swaps: list[tuple[torch.nn.Module, str, QuantExperts]] = []
    taken: set[str] = set()
    for name, spec in specs.items():
        layers = _expert_layers(checkpoint, spec)
        if not layers:
            continue
        if spec.problem is not None:
            raise CheckpointError(
                f"{folder}: the checkpoint quantizes the experts of {name!r} ({spec.module_type}), but {spec.problem}; "
                "load the checkpoint with qscheme.load_checkpoint(path) and call its layers"
            )
        act_fn, apply_gate = gating_of(model.get_submodule(name))  # _layout_problem refused a module with neither
        try:
            experts = QuantExperts.from_checkpoint(spec, layers, act_fn, apply_gate=apply_gate)
        except CheckpointError as exc:
            raise CheckpointError(f"{folder}: {exc}") from None
        parent_name, _, child = name.rpartition(".")
        swaps.append((model.get_submodule(parent_name) if parent_name else model, child, experts))
        taken.update(layers)
    return swaps, taken


def _stack_plain_experts(state: dict[str, torch.Tensor], specs: dict[str, ExpertsSpec]) -> dict[str, torch.Tensor]:
    """Unquantized per-expert weights (``<experts>.<e>.gate_proj.weight``...) stacked into the
    model's fused ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] (gate rows first)."""
    for name, spec in specs.items():
        keys = {
            (e, p): f"{name}.{e}.{p}.weight"
            for e in range(spec.num_experts)
            for p in ("gate_proj", "up_proj", "down_proj")
        }
        if not all(key in state for key in keys.values()) or spec.problem is not None:
            continue
        gate_up = [
            torch.cat([state[keys[(e, "gate_proj")]], state[keys[(e, "up_proj")]]]) for e in range(spec.num_experts)
        ]
        down = [state[keys[(e, "down_proj")]] for e in range(spec.num_experts)]
        state = {key: value for key, value in state.items() if key not in set(keys.values())}
        state[f"{name}.gate_up_proj"] = torch.stack(gate_up)
        state[f"{name}.down_proj"] = torch.stack(down)
    return state


Swap = tuple[torch.nn.Module, str, torch.nn.Module]  # (parent, attribute, replacement)
StateTransform = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


class ModelSplit(Protocol):
    """What a split changes in ``apply_to_model``'s phases: a single process (``WholeModel``) or
    one tensor-parallel rank (``qscheme.parallel.model.RankSplit``)."""

    what: str  # the caller named by the dtype-fallback warning
    absent_advice: str  # what the error for quantized layers the model lacks advises

    def check_model(self, model: torch.nn.Module) -> None: ...

    def load(
        self,
        path: str | Path,
        *,
        device: torch.device,
        kernel: str | None,
        fuse: FuseSpec | None,
        fuse_policy: FusePolicyChoice,
        activation_dtype: str,
        progress: bool | None,
    ) -> Checkpoint: ...

    def quantized(
        self, model: torch.nn.Module, checkpoint: Checkpoint, folder: Path
    ) -> tuple[list[Swap], list[str], tuple[str, ...], StateTransform]: ...

    def check_rest(self, model: torch.nn.Module, checkpoint: Checkpoint, absent: list[str]) -> None: ...

    def agree(self, absent: list[str]) -> None: ...

    def before_swaps(self, model: torch.nn.Module) -> None: ...

    def after_swaps(self, model: torch.nn.Module) -> None: ...

    def notes(self) -> list[str]: ...


class WholeModel:
    """A single process: the checkpoint's layers replace the model's Linear modules whole, and
    fused MoE experts take their per-expert layers (or their stacked plain weights)."""

    what = "apply_to_model"
    absent_advice = (
        "build the model from the checkpoint's config.json (fused modules need a model with fused layers), "
        "or pass strict=False to leave them out"
    )

    def __init__(self) -> None:
        self.expert_specs: dict[str, ExpertsSpec] = {}

    def check_model(self, model: torch.nn.Module) -> None:
        self.expert_specs = find_expert_modules(model)

    def load(
        self,
        path: str | Path,
        *,
        device: torch.device,
        kernel: str | None,
        fuse: FuseSpec | None,
        fuse_policy: FusePolicyChoice,
        activation_dtype: str,
        progress: bool | None,
    ) -> Checkpoint:
        return load_checkpoint(
            path,
            device=device,
            kernel=kernel,
            fuse=fuse,
            fuse_policy=fuse_policy,
            activation_dtype=activation_dtype,
            progress=progress,
        )

    def quantized(
        self, model: torch.nn.Module, checkpoint: Checkpoint, folder: Path
    ) -> tuple[list[Swap], list[str], tuple[str, ...], StateTransform]:
        """The swaps (experts: all of a module's or none), the layers the model lacks, the module
        prefixes whose own tensors are not loaded, and the plain experts' stacking."""
        expert_swaps, expert_layers = _build_experts(model, checkpoint, self.expert_specs, folder)
        swaps: list[Swap] = [*expert_swaps]
        absent: list[str] = []
        dequantized: dict[str, torch.Tensor] = {}
        for name, layer in checkpoint.items():
            if name in expert_layers:
                continue
            if _holds_weight_of(model, name, layer):
                dequantized[f"{name}.weight"] = layer.dequantize()
                continue
            place = _place(model, name, layer, folder)
            if place is None:
                absent.append(name)
            else:
                swaps.append((*place, layer))
        kept = {*absent, *expert_layers, *(weight.removesuffix(".weight") for weight in dequantized)}
        replaced = tuple(f"{name}." for name in checkpoint if name not in kept)
        replaced += tuple(f"{experts.spec.module}." for _, _, experts in expert_swaps)
        specs = self.expert_specs
        return swaps, absent, replaced, lambda state: {**_stack_plain_experts(state, specs), **dequantized}

    def check_rest(self, model: torch.nn.Module, checkpoint: Checkpoint, absent: list[str]) -> None:
        return None

    def agree(self, absent: list[str]) -> None:
        return None

    def before_swaps(self, model: torch.nn.Module) -> None:
        return None

    def after_swaps(self, model: torch.nn.Module) -> None:
        return None

    def notes(self) -> list[str]:
        return []


def apply_to_model(
    model: torch.nn.Module,
    path: str | Path,
    *,
    device: str | torch.device | None = None,
    kernel: str | None = None,
    fuse: FuseSpec | None = None,
    fuse_policy: FusePolicyChoice = None,
    strict: bool = True,
    progress: bool | None = None,
    tp_rank: int | None = None,
    tp_size: int | None = None,
    tp_plan: object = None,
    m_split: str | int | None = None,
) -> Checkpoint:
    """Replace the model's matching nn.Linear modules with QuantLinear and load the rest.

    ``device`` defaults to the model's; the kernels are resolved for the model's dtype. The
    model must be materialised (not on the meta device). ``strict`` is described in the module
    docstring. Everything is checked before the model is changed, so on any error the model is
    left as it was. Returns the loaded Checkpoint (its ``report`` says what was done).

    ``tp_rank`` and ``tp_size`` (together; ``tp_plan`` optional) make this rank's part of a
    tensor-parallel model on torch.distributed (``apply_to_model_tp``, docs/parallel.md).

    ``m_split`` overrides the kernels' declared batch ranges on every layer it loads, as
    ``QuantLinear(m_split=)`` and QSCHEME_M_SPLIT do (docs/plans.md; checked before the model changes).
    """
    require_flag(strict, "strict", "apply_to_model")
    if m_split is not None:
        m_split_override(m_split, origin="apply_to_model(m_split=...)")
    if tp_size is not None or tp_rank is not None or tp_plan is not None:
        if tp_size is None or tp_rank is None:
            raise UsageError(
                "apply_to_model: pass tp_rank and tp_size together, e.g. tp_rank=torch.distributed.get_rank(), "
                "tp_size=torch.distributed.get_world_size()"
            )
        return apply_to_model_tp(
            model,
            path,
            tp_rank,
            tp_size,
            tp_plan,
            device=device,
            kernel=kernel,
            fuse=fuse,
            fuse_policy=fuse_policy,
            strict=strict,
            progress=progress,
            m_split=m_split,
        )
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"apply_to_model: model must be a torch.nn.Module, not {type(model).__name__}")
    split = WholeModel()
    prepared = _prepare(model, path, split, device, kernel, fuse, fuse_policy, strict, progress)
    checkpoint = _change(model, prepared, split)
    _set_m_split(model, m_split)
    return checkpoint


def apply_to_model_tp(
    model: torch.nn.Module,
    path: str | Path,
    tp_rank: int,
    tp_size: int,
    tp_plan: object = None,
    *,
    device: str | torch.device | None = None,
    kernel: str | None = None,
    fuse: FuseSpec | None = None,
    fuse_policy: FusePolicyChoice = None,
    strict: bool = True,
    progress: bool | None = None,
    m_split: str | int | None = None,
) -> ShardedCheckpoint:
    """Make ``model`` rank ``tp_rank`` of a ``tp_size``-way tensor-parallel model of ``path``.

    Run on every rank of the default process group (``torchrun``), each with its rank. The
    quantized layers the plan splits load as this rank's shards (``load_checkpoint_tp``),
    wrapped to communicate (``qscheme.parallel.model``); the plain tensors load into the model
    as ``apply_to_model`` loads them. ``tp_plan``: module-name patterns -> ``column`` / ``row``
    / ``replicate`` (None: the Llama default). ``strict`` and the other arguments are
    ``apply_to_model``'s. Returns the rank's ShardedCheckpoint (its ``shards`` say how each
    layer was split, its ``bytes_read`` what this rank read).
    """
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"apply_to_model: model must be a torch.nn.Module, not {type(model).__name__}")
    tp_size, tp_rank = checked_degree(tp_size, tp_rank)
    require_flag(strict, "strict", "apply_to_model")
    if m_split is not None:
        m_split_override(m_split, origin="apply_to_model(m_split=...)")
    what = f"apply_to_model({str(path)!r}, tp_rank={tp_rank}, tp_size={tp_size})"
    with failures_shared(what, tp_rank, tp_size) as done:
        split = RankSplit(tp_rank, tp_size, checked_tp_plan(tp_plan), done)
        prepared = _prepare(model, path, split, device, kernel, fuse, fuse_policy, strict, progress)
    _change(model, prepared, split)
    _set_m_split(model, m_split)
    return split.checkpoint


def _set_m_split(model: torch.nn.Module, m_split: str | int | None) -> None:
    """``m_split`` on every QuantLinear of the model (the layers just loaded, experts' included)."""
    if m_split is None:
        return
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.set_m_split(m_split)


@dataclasses.dataclass
class _Prepared:
    """Everything checked, nothing changed yet."""

    checkpoint: Checkpoint
    swaps: list[Swap]
    absent: list[str]
    plain: PlainTensors


def _prepare(
    model: torch.nn.Module,
    path: str | Path,
    split: ModelSplit,
    device: str | torch.device | None,
    kernel: str | None,
    fuse: FuseSpec | None,
    fuse_policy: FusePolicyChoice,
    strict: bool,
    progress: bool | None,
) -> _Prepared:
    """Every check of the pipeline, in order, before the model is changed."""
    _refuse_meta(model)
    split.check_model(model)
    model_device, activation_dtype = _model_device_and_dtype(model)
    torch_device = checked_device(device, "apply_to_model") if device is not None else model_device
    checkpoint = split.load(
        path,
        device=torch_device,
        kernel=kernel,
        fuse=fuse,
        fuse_policy=fuse_policy,
        activation_dtype=activation_dtype,
        progress=progress,
    )
    folder = Path(path)

    # 1. Check every quantized module against the model's.
    swaps, absent, replaced, transform = split.quantized(model, checkpoint, folder)
    if absent and strict:
        raise CheckpointError(
            f"{folder}: the model has no module {_listing([repr(name) for name in absent])} for the checkpoint's "
            f"quantized layers; {split.absent_advice}"
        )

    # 2. Check every plain tensor; the replaced Linear modules' own weights are not loaded.
    plain = check_plain_tensors(model, checkpoint, replaced, folder, strict, transform)
    # 3. What else the split changes (a rank: the unquantized Linear modules it splits).
    split.check_rest(model, checkpoint, absent)
    _refuse_tied_conflicts(plain.state, plain.expected, folder)
    _refuse_unwritable(plain.state, plain.expected)
    split.agree(absent)
    return _Prepared(checkpoint, swaps, absent, plain)


def _change(model: torch.nn.Module, prepared: _Prepared, split: ModelSplit) -> Checkpoint:
    """Only now change the model: values in the targets' devices and dtypes first (the step that
    can run out of memory), then the copies (same shape, device and dtype), then the swaps."""
    checkpoint, plain = prepared.checkpoint, prepared.plain
    expected = plain.expected
    values = {
        name: value.to(device=expected[name].device, dtype=expected[name].dtype) for name, value in plain.state.items()
    }
    with torch.no_grad():
        for name, value in values.items():
            expected[name].copy_(value)
    split.before_swaps(model)
    for parent, child, replacement in prepared.swaps:
        setattr(parent, child, replacement)
    split.after_swaps(model)

    notes = split.notes()
    if prepared.absent:
        notes.append(
            f"apply_to_model: the model has no module for {_listing(prepared.absent)}; left out (strict=False)"
        )
    if plain.unexpected:
        notes.append(f"apply_to_model: the model has no tensor {_listing(plain.unexpected)}; left out (strict=False)")
    if plain.missing:
        notes.append(
            f"apply_to_model: the checkpoint does not provide {_listing(plain.missing)}; the model keeps its own"
        )
    if notes:
        checkpoint.report = dataclasses.replace(checkpoint.report, notes=(*checkpoint.report.notes, *notes))
    warn_dtype_fallbacks(model, split.what)
    return checkpoint


@dataclasses.dataclass
class PlainTensors:
    """The checkpoint's plain tensors matched to the model's (``check_plain_tensors``)."""

    state: dict[str, torch.Tensor]  # checkpoint tensors the model has, by state-dict name
    expected: dict[str, torch.Tensor]  # the model's tensors (not under a replaced module)
    unexpected: list[str]  # checkpoint tensors the model lacks (strict=False only)
    missing: list[str]  # model tensors the checkpoint does not provide (strict=False only)


def check_plain_tensors(
    model: torch.nn.Module,
    checkpoint: Checkpoint,
    replaced: tuple[str, ...],
    folder: Path,
    strict: bool,
    transform: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = lambda state: state,
) -> PlainTensors:
    """Match the checkpoint's plain tensors (``transform``-ed) to the model's state dict, leaving
    out modules under the ``replaced`` prefixes: CheckpointError for any shape mismatch, and with
    ``strict`` for tensors only one side has (tied tensors count as provided)."""
    expected = {
        name: value for name, value in model.state_dict(keep_vars=True).items() if not name.startswith(replaced)
    }
    kv_cache = set(checkpoint.report.kv_cache_tensors)
    state = transform({name: value for name, value in checkpoint.tensors.items() if name not in kv_cache})
    unexpected = sorted(set(state) - set(expected))
    if unexpected and strict:
        raise CheckpointError(
            f"{folder}: the checkpoint has tensors the model lacks: {_listing(unexpected)}; build the model from "
            "the checkpoint's config.json, or pass strict=False"
        )
    state = {name: value for name, value in state.items() if name in expected}
    mismatched = [name for name, value in state.items() if tuple(expected[name].shape) != tuple(value.shape)]
    if mismatched:
        first = mismatched[0]
        others = f" (and {_listing(mismatched[1:])})" if len(mismatched) > 1 else ""
        raise CheckpointError(
            f"{folder}: tensor {first!r} is {list(state[first].shape)} in the checkpoint but "
            f"{list(expected[first].shape)} in the model{others}; build the model from the checkpoint's config.json"
        )
    loaded = {id(expected[name]) for name in state} | {expected[name].data_ptr() for name in state}
    missing = [
        name
        for name, value in expected.items()
        if name not in state and id(value) not in loaded and value.data_ptr() not in loaded
    ]
    if missing and strict:
        raise CheckpointError(
            f"{folder}: the checkpoint does not provide the model's {_listing(missing)}; pass strict=False to keep "
            "the model's own values"
        )
    return PlainTensors(state, expected, unexpected, missing)
