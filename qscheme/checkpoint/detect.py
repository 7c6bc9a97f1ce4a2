"""Which scheme each checkpoint module uses, from the producer config and the descriptors' rules.

There is no format table here: a compressed-tensors config group is matched against every
scheme's ``detect.compressed-tensors`` rule (format + the arguments the rule lists), and a
ModelOpt quant_algo against every ``detect.modelopt`` rule.

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

import fnmatch
import functools
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from qscheme.checkpoint.config import (
    CompressedTensorsConfig,
    ConfigGroup,
    ModeloptConfig,
    NoQuantization,
    ProducerConfig,
    QschemeConfig,
    block_sizes,
)
from qscheme.checkpoint.patterns import MAX_NAME_LENGTH, any_of, compile_entries, compile_pattern
from qscheme.checkpoint.patterns import PREFIX as PATTERN_PREFIX
from qscheme.descriptor import CompressedTensorsRule, Scheme
from qscheme.errors import CheckpointError
from qscheme.storage import TensorInfo
from qscheme.tensor_checks import FLOAT_DTYPES
from qscheme.text import cut, listing, shown

EMBEDDED_PROBLEMS_SHOWN = 20  # problems of an embedded descriptor listed in the error (then a count)
# Per-layer tensors that belong to the KV cache, not to the linear (kept as plain tensors when
# the config declares KV-cache quantization): scales, and an affine KV cache's biases, which
# ModelOpt stores under the projection they follow (k_proj.k_bias, v_proj.v_bias).
KV_CACHE_TENSORS = frozenset({"k_scale", "v_scale", "q_scale", "prob_scale"})
KV_CACHE_BIASES = {"k_bias": "k_proj", "v_bias": "v_proj"}


def is_kv_cache_tensor(module: str, short: str) -> bool:
    """Whether ``module.short`` is a KV-cache tensor (when the config declares a KV cache)."""
    return short in KV_CACHE_TENSORS or KV_CACHE_BIASES.get(short) == module.rpartition(".")[2]


# compressed-tensors QuantizationArgs defaults, applied to what a config leaves out.
_ARGUMENT_DEFAULTS: dict[str, Any] = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False}
_IGNORED_ARGUMENTS = frozenset({"observer", "observer_kwargs"})


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


# ---------------------------------------------------------------------------- module grouping


def natural_key(name: str) -> tuple[object, ...]:
    """Sort ``layers.2`` before ``layers.10``."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def split_name(tensor: str) -> tuple[str, str]:
    """``model.layers.0.q_proj.weight_scale`` -> (``model.layers.0.q_proj``, ``weight_scale``)."""
    module, _, short = tensor.rpartition(".")
    return module, short


def group_by_module(tensors: Mapping[str, TensorInfo]) -> dict[str, dict[str, TensorInfo]]:
    modules: dict[str, dict[str, TensorInfo]] = {}
    for name, info in tensors.items():
        module, short = split_name(name)
        modules.setdefault(module, {})[short] = info
    return modules


def quantized_tensor_names(schemes: Iterable[Scheme]) -> frozenset[str]:
    """Every tensor name a scheme declares for a quantized linear, except the plain ``weight``."""
    names: set[str] = set()
    for scheme in schemes:
        names.update(spec.name for spec in scheme.tensor_specs().values())
        names.update(scheme.tolerated)
    names.discard("weight")
    return frozenset(names)


def looks_quantized(tensors: Mapping[str, TensorInfo], quantized_names: frozenset[str]) -> bool:
    """Does a module store quantized-linear tensors (see the module docstring)?"""
    if any(short in quantized_names for short in tensors):
        return True
    weight = tensors.get("weight")
    return weight is not None and weight.dtype not in FLOAT_DTYPES


def looks_linear(tensors: Mapping[str, TensorInfo], quantized_names: frozenset[str]) -> bool:
    weight = tensors.get("weight")
    return looks_quantized(tensors, quantized_names) or (weight is not None and len(weight.shape) == 2)


def _is_class_target(target: str) -> bool:
    return not target.startswith(PATTERN_PREFIX) and "." not in target and target[:1].isupper()


def _is_linear_class(target: str) -> bool:
    return target.endswith("Linear")


def _match_rank(module: str, target: str, quantized: bool, compiled: Mapping[str, re.Pattern[str]]) -> int | None:
    """0 exact name, 1 regex, 2 class name; None when the target does not match.

    ``compiled`` holds every ``re:`` target's pattern (see ``_config_patterns``)."""
    if target.startswith(PATTERN_PREFIX):
        return 1 if compiled[target].match(module) else None
    if target == module:
        return 0
    if _is_class_target(target) and _is_linear_class(target) and quantized:
        return 2
    return None


@dataclass(frozen=True)
class _Entries:
    """Targets or ignore entries, each paired with its owner, prepared for thousands of modules:
    a module that no entry can match is told apart with a set lookup and one joined regex."""

    pairs: tuple[tuple[Any, str], ...]
    names: frozenset[str]
    linear_class: bool
    regexes: bool
    any_regex: re.Pattern[str] | None
    compiled: Mapping[str, re.Pattern[str]]

    @classmethod
    def of(cls, pairs: Iterable[tuple[Any, str]], compiled: Mapping[str, re.Pattern[str]]) -> _Entries:
        pairs = tuple(pairs)
        entries = [entry for _, entry in pairs]
        return cls(
            pairs=pairs,
            names=frozenset(entries),
            linear_class=any(_is_class_target(e) and _is_linear_class(e) for e in entries),
            regexes=any(e.startswith(PATTERN_PREFIX) for e in entries),
            any_regex=any_of(entries, compiled),
            compiled=compiled,
        )

    def possible(self, module: str, quantized: bool) -> bool:
        """Whether any entry matches ``module`` (one set lookup and one joined regex)."""
        return (
            module in self.names
            or (self.linear_class and quantized)
            or (self.regexes and (self.any_regex is None or self.any_regex.match(module) is not None))
        )

    def matching(self, module: str, quantized: bool) -> list[tuple[int, Any, str]]:
        """(rank, owner, entry) of every entry that matches ``module``, in order (see _match_rank)."""
        if not self.possible(module, quantized):
            return []
        return [
            (rank, owner, entry)
            for owner, entry in self.pairs
            if (rank := _match_rank(module, entry, quantized, self.compiled)) is not None
        ]


# ---------------------------------------------------------------------------- argument matching


def normalize_arguments(arguments: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A compressed-tensors argument object in one comparable form (0.19 and 0.20 alike).

    Nulls and observer settings are dropped, defaults filled in, the strategy inferred as the
    library does, dtype strings lose their ``torch.`` prefix, ``dynamic: "local"`` and
    ``dynamic: true`` both read "dynamic", block structures become [rows, columns].
    """
    if arguments is None:
        return None
    out: dict[str, Any] = {}
    for key, value in arguments.items():
        if value is None or key in _IGNORED_ARGUMENTS:
            continue
        out[key] = value
    for key, value in _ARGUMENT_DEFAULTS.items():
        out.setdefault(key, value)
    if "strategy" not in out:
        size = out.get("group_size")
        out["strategy"] = "tensor" if size is None else "channel" if size == -1 else "group"
    for key in ("strategy", "type"):
        if isinstance(out.get(key), str):
            out[key] = out[key].lower()
    for key in ("scale_dtype", "zp_dtype"):
        if isinstance(out.get(key), str):
            out[key] = out[key].removeprefix("torch.")
    if out.get("dynamic") in (True, "local", "true", "True"):
        out["dynamic"] = "dynamic"
    elif out.get("dynamic") in (False, "false", "False"):
        out["dynamic"] = False
    sizes = block_sizes(out.get("block_structure"))
    if sizes is not None:
        out["block_structure"] = sizes  # else kept as written: it matches no rule
    return out


def argument_differences(rule: Mapping[str, Any] | None, found: Mapping[str, Any] | None, what: str) -> list[str]:
    """How a config's argument object differs from a rule's (empty when it matches)."""
    if rule is None and found is None:
        return []
    if rule is None:
        return [f"{what} present but the scheme has none"]
    if found is None:
        return [f"{what} absent but the scheme quantizes them"]
    expected = normalize_arguments(rule) or {}
    actual = normalize_arguments(found) or {}
    return [
        f"{what}.{key} is {_show(actual.get(key))}, scheme has {_show(expected[key])}"
        for key in rule
        if expected.get(key) != actual.get(key)
    ]


def _show(value: Any) -> str:
    if value == "dynamic":
        return "dynamic"
    return json.dumps(value)


def rule_differences(
    rule: CompressedTensorsRule, group: ConfigGroup, fallback_format: str | None
) -> tuple[int, list[str]]:
    """(distance, differences) of a config group from a rule: 0 and [] when it matches.

    The distance ranks the nearest schemes: a different format counts most, then each
    weight argument, then the presence of activation quantization, then each input argument.
    """
    differences: list[str] = []
    distance = 0
    fmt = group.format or fallback_format
    if fmt is not None and fmt != "mixed-precision" and fmt not in rule.formats:
        differences.append(f"format is {fmt!r}, scheme has {' or '.join(repr(f) for f in rule.formats)}")
        distance += 20
    weights = argument_differences(rule.weights, group.weights, "weights")
    inputs = argument_differences(rule.input_activations, group.input_activations, "input_activations")
    presence = (rule.input_activations is None) != (group.input_activations is None)
    distance += 4 * len(weights) + (3 if presence else len(inputs))
    return distance, differences + weights + inputs


def describe_arguments(arguments: Mapping[str, Any] | None) -> str:
    if arguments is None:
        return "none"
    normalized = normalize_arguments(arguments) or {}
    shown = {k: v for k, v in normalized.items() if k not in ("scale_dtype", "zp_dtype")}
    return "{" + ", ".join(f"{k}: {_show(v)}" for k, v in shown.items()) + "}"


def match_config_group(
    group: ConfigGroup, config: CompressedTensorsConfig, schemes: Iterable[Scheme], module: str
) -> Scheme:
    """The one scheme whose compressed-tensors rule matches a config group; CheckpointError otherwise.
    (Groups with output_activations, or activations without weights, never get here:
    ``_refuse_groups_without_weights`` refuses them first.)"""
    if group.weights is None:
        raise CheckpointError(f"{config.file}: {group.key_path}: no weights arguments (module {module})")
    scored: list[tuple[int, str, list[str]]] = []
    matches: list[Scheme] = []
    candidates = {scheme.name: scheme for scheme in schemes}
    for scheme in candidates.values():
        rule = scheme.detect.compressed_tensors
        if rule is None:
            continue
        distance, differences = rule_differences(rule, group, config.format)
        if not differences:
            matches.append(scheme)
        scored.append((distance, scheme.name, differences))
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        names = ", ".join(sorted(s.name for s in matches))
        raise CheckpointError(
            f"{config.file}: {group.key_path} (module {module}) matches several schemes: {names}; "
            "their detect rules overlap: make one of them more specific"
        )
    scored.sort()
    nearest = "; ".join(f"{name} ({', '.join(diff)})" for _, name, diff in scored[:3])
    raise CheckpointError(
        f"{config.file}: module {module} ({group.key_path}, format {group.format or config.format!r}): no scheme "
        f"matches weights {describe_arguments(group.weights)} with input_activations "
        f"{describe_arguments(group.input_activations)}. Nearest schemes: {nearest}. "
        "Add a scheme descriptor for this combination (see docs/schemes.md) or re-export the checkpoint."
    )


def match_modelopt_algo(
    quant_algo: str, group_size: int | None, schemes: Iterable[Scheme], file: str, where: str
) -> Scheme:
    """The scheme whose ModelOpt rule names ``quant_algo`` (case-insensitive)."""
    import difflib

    known: dict[str, list[Scheme]] = {}
    for scheme in schemes:
        rule = scheme.detect.modelopt
        if rule is None:
            continue
        for algo in rule.quant_algos:
            known.setdefault(algo.upper(), []).append(scheme)
    candidates = known.get(quant_algo.upper(), [])
    if not candidates:
        close = difflib.get_close_matches(quant_algo.upper(), list(known), n=3, cutoff=0.4)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise CheckpointError(
            f"{file}: {where}quant_algo {quant_algo!r} is not known to any scheme.{hint} Known: "
            f"{', '.join(sorted(known))}. Add a scheme descriptor with detect.modelopt.quant_algo: {quant_algo}."
        )
    fitting = [
        s
        for s in candidates
        if s.detect.modelopt is not None
        and (s.detect.modelopt.group_size is None or group_size is None or s.detect.modelopt.group_size == group_size)
    ]
    if not fitting:
        sizes = ", ".join(f"{s.name}: group {s.detect.modelopt.group_size}" for s in candidates if s.detect.modelopt)
        raise CheckpointError(
            f"{file}: {where}quant_algo {quant_algo!r} with group_size {group_size} matches no scheme ({sizes})"
        )
    if len(fitting) > 1:
        exact = [s for s in fitting if s.detect.modelopt is not None and s.detect.modelopt.group_size == group_size]
        if len(exact) != 1:
            raise CheckpointError(
                f"{file}: {where}quant_algo {quant_algo!r} matches several schemes: "
                f"{', '.join(s.name for s in fitting)}; make their detect rules distinct"
            )
        fitting = exact
    _check_modelopt_group_size(fitting[0], quant_algo, group_size, file, where)
    return fitting[0]


def _check_modelopt_group_size(scheme: Scheme, quant_algo: str, group_size: int | None, file: str, where: str) -> None:
    """A ModelOpt ``group_size`` must be positive and equal the scheme's weight group size."""
    if group_size is None:
        return
    if group_size < 1:
        raise CheckpointError(
            f"{file}: {where}group_size is {group_size}; expected a positive number of weights per scale "
            f"(scheme {scheme.name} uses {scheme.group_size or 'no groups'})"
        )
    if scheme.weight.scale.granularity == "group" and scheme.group_size != group_size:
        raise CheckpointError(
            f"{file}: {where}quant_algo {quant_algo!r} with group_size {group_size}: scheme {scheme.name} "
            f"stores one weight scale per {scheme.group_size} weights, so these tensors cannot be read with "
            f"group_size {group_size}. Fix group_size if it is wrong, or add a scheme descriptor with "
            f"detect.modelopt.group_size: {group_size} (see docs/schemes.md)"
        )


# ---------------------------------------------------------------------------- detection


def detect(config: ProducerConfig, tensors: Mapping[str, TensorInfo], schemes: Iterable[Scheme]) -> Detection:
    """Assign every module of a checkpoint its scheme (or none); CheckpointError on conflicts."""
    schemes = list(schemes)
    _refuse_long_names(tensors)
    modules = group_by_module(tensors)
    quantized_names = quantized_tensor_names(schemes)
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
    if isinstance(config, QschemeConfig):
        scheme = embedded_scheme(config)
        assigned, ignored = _detect_self_described(config, scheme, modules, quantized_tensor_names([scheme]))
        unused: list[str] = []
    elif isinstance(config, CompressedTensorsConfig):
        assigned, ignored, unused = _detect_compressed_tensors(config, modules, schemes, quantized_names)
    else:
        assigned, ignored = _detect_modelopt(config, modules, schemes, quantized_names)
        unused = []
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
        unused_targets=tuple(unused),
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


def _config_patterns(config: CompressedTensorsConfig) -> dict[str, re.Pattern[str]]:
    """Every re: target and ignore entry compiled: those read from config.json were checked and
    compiled then; a hand-built config's are checked here."""
    compiled = dict(config.patterns)
    for group in config.groups:
        compile_entries(group.targets, compiled)
    return compile_entries(config.ignore, compiled)


def _file_of(tensors: Mapping[str, TensorInfo]) -> str:
    return str(next(iter(tensors.values())).file) if tensors else "?"


def _describe_tensors(tensors: Mapping[str, TensorInfo], limit: int = 6) -> str:
    described = [
        f"{short} ({info.dtype} {list(info.shape)})"
        for short, info in sorted(tensors.items(), key=lambda item: natural_key(item[0]))
    ]
    return listing(described, limit)


def _refuse_unconfigured(
    config: NoQuantization, modules: Mapping[str, Mapping[str, TensorInfo]], quantized_names: frozenset[str]
) -> None:
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


def _detect_compressed_tensors(
    config: CompressedTensorsConfig,
    modules: Mapping[str, Mapping[str, TensorInfo]],
    schemes: list[Scheme],
    quantized_names: frozenset[str],
) -> tuple[dict[str, tuple[Scheme, str]], dict[str, str], list[str]]:
    compiled = _config_patterns(config)
    _refuse_groups_without_weights(config, modules, quantized_names, compiled)
    _refuse_names_of_no_module(config, modules)
    assigned: dict[str, tuple[Scheme, str]] = {}
    ignored: dict[str, str] = {}
    group_schemes: dict[str, Scheme] = {}
    used_targets: set[tuple[str, str]] = set()
    ignore = _Entries.of(((None, entry) for entry in config.ignore), compiled)
    targets = _Entries.of(((group, target) for group in config.groups for target in group.targets), compiled)
    for module, members in sorted(modules.items()):
        quantized = looks_quantized(members, quantized_names)
        if not module or not looks_linear(members, quantized_names):
            continue
        ignore_entry = next((entry for _, _, entry in ignore.matching(module, quantized)), None)
        if ignore_entry is not None:
            if quantized:
                raise CheckpointError(
                    f"{config.file}: module {module} is in quantization_config.ignore ({ignore_entry!r}) but "
                    f"stores quantized tensors ({', '.join(sorted(members))}); the config does not describe "
                    "these weights"
                )
            ignored[module] = ignore_entry
            continue
        best: list[tuple[int, ConfigGroup, str]] = targets.matching(module, quantized)
        if not best:
            if quantized:
                raise CheckpointError(
                    f"{config.file}: module {module} stores quantized tensors ({', '.join(sorted(members))}) but no "
                    f"config group targets it and it is not in ignore{_other_class_targets(config)}"
                )
            continue
        top = min(rank for rank, _, _ in best)
        winners = {group.name: (group, target) for rank, group, target in best if rank == top}
        if len(winners) > 1:
            raise CheckpointError(
                f"{config.file}: module {module} is targeted equally by config groups "
                f"{', '.join(sorted(winners))}; make one target more specific"
            )
        group, target = next(iter(winners.values()))
        used_targets.add((group.name, target))
        scheme = group_schemes.get(group.name)
        if scheme is None:
            scheme = match_config_group(group, config, schemes, module)
            group_schemes[group.name] = scheme
        assigned[module] = (scheme, f"{group.key_path} (target {target!r})")
    unused = [
        f"{group.key_path} target {target!r}"
        for group in config.groups
        for target in group.targets
        if (group.name, target) not in used_targets
    ]
    return assigned, ignored, unused


def _refuse_groups_without_weights(
    config: CompressedTensorsConfig,
    modules: Mapping[str, Mapping[str, TensorInfo]],
    quantized_names: frozenset[str],
    compiled: Mapping[str, re.Pattern[str]],
) -> None:
    """A group that targets linear layers and quantizes their activations but not their weights
    (or their outputs) describes no quantized linear: refuse it by name, whether or not its
    layers look quantized. Groups of other modules (attention, for the KV cache: targets such as
    'LlamaAttention') are not about linear layers and pass."""
    for group in config.groups:
        outputs = group.output_activations is not None
        activations_only = group.weights is None and (group.input_activations is not None or outputs)
        if not (activations_only or outputs) or not _targets_linear_layers(group, modules, quantized_names, compiled):
            continue
        if activations_only:
            raise CheckpointError(
                f"{config.file}: {group.key_path} quantizes activations only (weights: null, input_activations "
                f"{describe_arguments(group.input_activations)}); no scheme describes activation-only quantization "
                "(the weights are plain floats): load the model without it, or quantize the weights too"
            )
        raise CheckpointError(
            f"{config.file}: {group.key_path}: output_activations quantization is not supported; no scheme "
            "describes it: re-export without output_activations"
        )


def _targets_linear_layers(
    group: ConfigGroup,
    modules: Mapping[str, Mapping[str, TensorInfo]],
    quantized_names: frozenset[str],
    compiled: Mapping[str, re.Pattern[str]],
) -> bool:
    """Whether a group's targets name linear layers: a linear class, or a name or regex that
    matches a module stored like a linear (a 2-D weight or quantized-linear tensors)."""
    targets = _Entries.of(((None, target) for target in group.targets), compiled)
    if targets.linear_class:
        return True
    return any(
        module and looks_linear(members, quantized_names) and targets.matching(module, True)
        for module, members in modules.items()
    )


def _refuse_names_of_no_module(
    config: CompressedTensorsConfig, modules: Mapping[str, Mapping[str, TensorInfo]]
) -> None:
    """A target that names a module exactly must name one of the checkpoint's: otherwise the
    config and the tensors disagree on module names (transformers 5 stores vision-language models
    under other names than it runs them), and the layers it meant would silently take another
    group's scheme."""
    for group in config.groups:
        for target in group.targets:
            if target.startswith(PATTERN_PREFIX) or _is_class_target(target) or target in modules:
                continue
            tail = ".".join(target.split(".")[-3:])
            alike = sorted((m for m in modules if m.endswith("." + tail) or m == tail), key=natural_key)
            hint = f"; the checkpoint stores {listing([repr(m) for m in alike], 3)}" if alike else ""
            raise CheckpointError(
                f"{config.file}: {group.key_path} target {target!r} names no module of the checkpoint{hint}. Targets "
                "must use the names the tensors are stored under (transformers 5 saves vision-language models under "
                "other module names than it runs them, e.g. 'language_model.model.layers.0...' for "
                "'model.language_model.layers.0...'): write the stored names in config.json, or re-export"
            )


def _other_class_targets(config: CompressedTensorsConfig) -> str:
    """The groups' class targets that are not linear layers (e.g. 'Embedding'), as a reason."""
    others = sorted(
        {t for group in config.groups for t in group.targets if _is_class_target(t) and not _is_linear_class(t)}
    )
    if not others:
        return ""
    return (
        f"; the config also targets module classes {', '.join(repr(t) for t in others)}, which qscheme does not "
        "load: only linear layers become QuantLinear (quantized embeddings and other modules are not supported)"
    )


def _detect_modelopt(
    config: ModeloptConfig,
    modules: Mapping[str, Mapping[str, TensorInfo]],
    schemes: list[Scheme],
    quantized_names: frozenset[str],
) -> tuple[dict[str, tuple[Scheme, str]], dict[str, str]]:
    assigned: dict[str, tuple[Scheme, str]] = {}
    ignored: dict[str, str] = {}
    layers = config.quantized_layers
    default_scheme = None
    if layers is None:
        default_scheme = match_modelopt_algo(config.quant_algo, config.group_size, schemes, config.file, "")
    else:
        for module in layers:
            if module not in modules:
                raise CheckpointError(
                    f"{config.file}: quantized_layers names {module!r}, but the checkpoint has no tensors under it"
                )
    layer_schemes: dict[str, Scheme] = {}
    for module, members in sorted(modules.items()):
        quantized = looks_quantized(members, quantized_names)
        if not module:
            continue
        excluded = next((p for p in config.exclude_modules if fnmatch.fnmatchcase(module, p)), None)
        if layers is not None:
            entry = layers.get(module)
            if entry is None:
                if quantized:
                    raise CheckpointError(
                        f"{config.file}: module {module} stores quantized tensors ({', '.join(sorted(members))}) "
                        "but is not listed in quantized_layers"
                    )
                continue
            key = f"{entry.quant_algo}/{entry.group_size}"
            if key not in layer_schemes:
                layer_schemes[key] = match_modelopt_algo(
                    entry.quant_algo, entry.group_size, schemes, config.file, f"quantized_layers.{module}: "
                )
            assigned[module] = (layer_schemes[key], f"quantized_layers.{module} ({entry.quant_algo})")
            continue
        if excluded is not None:
            if quantized:
                raise CheckpointError(
                    f"{config.file}: module {module} is excluded ({excluded!r}) but stores quantized tensors "
                    f"({', '.join(sorted(members))}); the config does not describe these weights"
                )
            if looks_linear(members, quantized_names):
                ignored[module] = excluded
            continue
        if quantized:
            assert default_scheme is not None
            assigned[module] = (default_scheme, f"quant_algo {config.quant_algo}")
    return assigned, ignored


def embedded_scheme(config: QschemeConfig) -> Scheme:
    """The scheme a self-describing config embeds; CheckpointError naming the config when it does
    not parse or is not the scheme it names."""
    from qscheme.descriptor import parse_scheme_text
    from qscheme.errors import SchemeError

    where = f"<{config.file}: quantization_config.descriptor>"
    try:
        scheme = parse_scheme_text(config.descriptor, where, source="checkpoint")
    except SchemeError as exc:
        problems = [str(problem) for problem in exc.problems] or [str(exc)]
        listed = problems[:EMBEDDED_PROBLEMS_SHOWN]
        more = len(problems) - len(listed)
        raise CheckpointError(
            f"{config.file}: quantization_config.descriptor (scheme {config.scheme!r}) is not a valid scheme "
            f"descriptor ({len(problems)} problem(s)):\n"
            + "\n".join(cut(problem, 1000) for problem in listed)
            + (f"\n... and {more} more problem(s) like these" if more else "")
            + "\nre-write the checkpoint with `qscheme quantize`"
        ) from None
    if scheme.name != config.scheme:
        raise CheckpointError(
            f"{config.file}: quantization_config.scheme is {config.scheme!r} but the embedded descriptor is named "
            f"{scheme.name!r}; the two must agree: fix the config or re-write the checkpoint"
        )
    return scheme


@functools.lru_cache(maxsize=256)
def _checked_pattern(entry: str) -> re.Pattern[str]:
    """``compile_pattern`` for ``ignored_by``'s callers that pass no compiled entry (checked once)."""
    return compile_pattern(entry)


def ignored_by(module: str, entries: Iterable[str], compiled: Mapping[str, re.Pattern[str]]) -> str | None:
    """The first ignore entry matching ``module`` (exact name, ``re:`` pattern from ``compiled``, or
    shell wildcard), or None. The writer matches ``--ignore`` with this same function.

    Bounded whatever the caller passes: a ``re:`` entry missing from ``compiled`` is checked for
    catastrophic backtracking before it runs (``compile_pattern``, CheckpointError when refused),
    and a module name longer than MAX_NAME_LENGTH is a CheckpointError before any pattern runs."""
    if len(module) > MAX_NAME_LENGTH:
        raise CheckpointError(
            f"module {shown(module, 80)} has a name of {len(module):,} characters; qscheme matches names of at most "
            f"{MAX_NAME_LENGTH:,} characters (real module names are under ~300), so that re: patterns run in "
            "bounded time: rename the tensor, or re-export the checkpoint"
        )
    for entry in entries:
        if entry.startswith(PATTERN_PREFIX):
            pattern = compiled.get(entry)
            if pattern is None:
                pattern = _checked_pattern(entry)
            if pattern.match(module):
                return entry
        elif any(char in entry for char in "*?["):
            if fnmatch.fnmatchcase(module, entry):
                return entry
        elif entry == module:
            return entry
    return None


def _detect_self_described(
    config: QschemeConfig,
    scheme: Scheme,
    modules: Mapping[str, Mapping[str, TensorInfo]],
    quantized_names: frozenset[str],
) -> tuple[dict[str, tuple[Scheme, str]], dict[str, str]]:
    assigned: dict[str, tuple[Scheme, str]] = {}
    ignored: dict[str, str] = {}
    compiled = compile_entries(config.ignore, {}, config.file, "quantization_config.ignore")
    for module, members in sorted(modules.items()):
        if not module or not looks_linear(members, quantized_names):
            continue
        quantized = looks_quantized(members, quantized_names)
        entry = ignored_by(module, config.ignore, compiled)
        if entry is not None:
            if quantized:
                raise CheckpointError(
                    f"{config.file}: module {module} is in quantization_config.ignore ({entry!r}) but stores "
                    f"quantized tensors ({', '.join(sorted(members))}); the config does not describe these weights"
                )
            ignored[module] = entry
        elif quantized:
            assigned[module] = (scheme, f"quantization_config.descriptor (scheme {scheme.name})")
    return assigned, ignored
