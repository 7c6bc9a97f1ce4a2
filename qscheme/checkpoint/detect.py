"""Which scheme each checkpoint module uses, from the producer config and the descriptors' rules.

There is no format table here, and no producer by name: the producer whose config was read
(``qscheme.producers.PRODUCERS``) assigns the modules, from its folder's ``detect`` module: a
compressed-tensors config group is matched against every scheme's ``detect.compressed-tensors``
rule (format + the arguments the rule lists), a ModelOpt quant_algo against every
``detect.modelopt`` rule. What is shared (the top-level and unconfigured refusals, the KV cache,
the result) is here; the module view and target matching are in ``qscheme.producers.base``.

Targets. A checkpoint stores tensors, not module classes, so a class-name target ("Linear",
or any name ending in "Linear") means "every module that stores quantized-linear tensors":
a tensor named like one any catalog scheme declares (weight_packed, weight_scale, ...) other
than a plain ``weight``, or a ``weight`` whose dtype is not a float type (fp8, int8, ...).
Name targets follow compressed-tensors: an exact module name, or ``re:<regex>`` matched with
``re.match`` from the start of the name (patterns that could backtrack catastrophically are
refused, and so are tensor names longer than ``MAX_NAME_LENGTH``, see patterns.py); they apply
to modules with a 2-D ``weight`` or quantized-linear tensors. When several groups target a
module the most specific wins (exact name, then regex, then class), as in compressed-tensors.
ModelOpt's exclude_modules and ignore lists are fnmatch wildcards.

A self-describing config (``quant_method: qscheme``) names no detection rule: its embedded
descriptor is parsed, and every module storing that scheme's tensors (and not in its ``ignore``:
exact names, ``re:`` patterns or wildcards) uses it, whatever the catalog holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from qscheme.checkpoint.config import NoQuantization, ProducerConfig
from qscheme.checkpoint.patterns import MAX_NAME_LENGTH
from qscheme.descriptor import Scheme
from qscheme.errors import CheckpointError
from qscheme.producers import producer_of_config
from qscheme.producers.base import (
    Modules,
    dotted_tensor_names,
    group_by_module,
    ignored_by,
    looks_quantized,
    natural_key,
    quantized_tensor_names,
    split_name,
)
from qscheme.storage import TensorInfo
from qscheme.text import listing, shown

__all__ = [
    "Detection",
    "ModuleAssignment",
    "detect",
    "group_by_module",
    "ignored_by",
    "is_kv_cache_tensor",
    "natural_key",
    "split_name",
]

# Per-layer tensors that belong to the KV cache, not to the linear (kept as plain tensors when
# the config declares KV-cache quantization): scales, and an affine KV cache's biases, which
# ModelOpt stores under the projection they follow (k_proj.k_bias, v_proj.v_bias).
KV_CACHE_TENSORS = frozenset({"k_scale", "v_scale", "q_scale", "prob_scale"})
KV_CACHE_BIASES = {"k_bias": "k_proj", "v_bias": "v_proj"}


def is_kv_cache_tensor(module: str, short: str) -> bool:
    """Whether ``module.short`` is a KV-cache tensor (when the config declares a KV cache)."""
    return short in KV_CACHE_TENSORS or KV_CACHE_BIASES.get(short) == module.rpartition(".")[2]


@dataclass(frozen=True)
class ModuleAssignment:
    """A quantized module: its scheme, why (config origin), and its tensors by short name."""

    module: str
    scheme: Scheme
    origin: str
    tensors: Mapping[str, TensorInfo]


@dataclass(frozen=True)
class Detection:
    """Every module's fate: quantized with a scheme, ignored, or plain tensors."""

    producer: ProducerConfig
    modules: dict[str, ModuleAssignment]
    ignored: dict[str, str]  # module -> the ignore / exclude entry that matched
    plain: tuple[str, ...]  # tensor names returned as plain tensors (embeddings, norms, ignored, ...)
    kv_cache: tuple[str, ...] = ()
    unused_targets: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)

    def scheme_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for assignment in self.modules.values():
            counts[assignment.scheme.name] = counts.get(assignment.scheme.name, 0) + 1
        return dict(sorted(counts.items()))


# ---------------------------------------------------------------------------- detection


def detect(config: ProducerConfig, tensors: Mapping[str, TensorInfo], schemes: Iterable[Scheme]) -> Detection:
    """Assign every module of a checkpoint its scheme (or none); CheckpointError on conflicts."""
    schemes = list(schemes)
    _refuse_long_names(tensors)
    quantized_names = quantized_tensor_names(schemes)
    modules = group_by_module(tensors, dotted_tensor_names(schemes))
    top_level = modules.get("", {})
    if looks_quantized(top_level, quantized_names):
        raise CheckpointError(
            f"{_file_of(top_level)}: tensors {_describe_tensors(top_level)} look quantized but have no module "
            "prefix (expected names like 'model.layers.0.mlp.down_proj.weight_packed'), so no layer can be "
            "built from them; re-export the checkpoint with the module names kept"
        )
    if isinstance(config, NoQuantization):
        _refuse_unconfigured(config, modules, quantized_names)
        return Detection(producer=config, modules={}, ignored={}, plain=tuple(sorted(tensors)))
    detected = producer_of_config(config).detect(config, modules, schemes, quantized_names)
    assigned, ignored = detected.assigned, detected.ignored
    plain: list[str] = []
    kv_cache: list[str] = []
    for module, members in modules.items():
        for short in members:
            full = f"{module}.{short}" if module else short
            if config.has_kv_cache and is_kv_cache_tensor(module, short):
                kv_cache.append(full)
            elif module not in assigned:
                plain.append(full)
    final = {
        module: ModuleAssignment(
            module=module,
            scheme=scheme,
            origin=origin,
            tensors={
                short: info
                for short, info in modules[module].items()
                if not (config.has_kv_cache and is_kv_cache_tensor(module, short))
            },
        )
        for module, (scheme, origin) in sorted(assigned.items(), key=lambda item: natural_key(item[0]))
    }
    return Detection(
        producer=config,
        modules=final,
        ignored=dict(sorted(ignored.items(), key=lambda item: natural_key(item[0]))),
        plain=tuple(sorted(plain, key=natural_key)),
        kv_cache=tuple(sorted(kv_cache, key=natural_key)),
        unused_targets=detected.unused_targets,
    )


def _refuse_long_names(tensors: Mapping[str, TensorInfo]) -> None:
    """Before any pattern runs: a name longer than MAX_NAME_LENGTH would let an accepted config
    regex take minutes (see patterns.py)."""
    name = next((name for name in tensors if len(name) > MAX_NAME_LENGTH), None)
    if name is None:
        return
    raise CheckpointError(
        f"{tensors[name].file}: tensor {shown(name, 80)} has a name of {len(name):,} characters; qscheme reads "
        f"tensor names of at most {MAX_NAME_LENGTH:,} characters (real module names are under ~300), so that "
        "config.json re: patterns match in bounded time: rename the tensor, or re-export the checkpoint"
    )


def _file_of(tensors: Mapping[str, TensorInfo]) -> str:
    return str(next(iter(tensors.values())).file) if tensors else "?"


def _describe_tensors(tensors: Mapping[str, TensorInfo], limit: int = 6) -> str:
    described = [
        f"{short} ({info.dtype} {list(info.shape)})"
        for short, info in sorted(tensors.items(), key=lambda item: natural_key(item[0]))
    ]
    return listing(described, limit)


def _refuse_unconfigured(config: NoQuantization, modules: Modules, quantized_names: frozenset[str]) -> None:
    """Without a quantization config every tensor is plain: refuse modules that look quantized."""
    suspects = sorted(
        (module for module, members in modules.items() if module and looks_quantized(members, quantized_names)),
        key=natural_key,
    )
    if not suspects:
        return
    first = modules[suspects[0]]
    where = config.file or str(next(iter(first.values())).file.parent)
    others = f" (and {len(suspects) - 1} more modules)" if len(suspects) > 1 else ""
    raise CheckpointError(
        f"{where}: {config.reason}, so every tensor would load as a plain tensor, but module {suspects[0]}"
        f"{others} stores quantized-looking tensors: {_describe_tensors(first)}. Add the producer's "
        "quantization_config to config.json (compressed-tensors / llm-compressor) or its hf_quant_config.json "
        "(ModelOpt) next to the weights"
    )
