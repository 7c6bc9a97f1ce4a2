"""Which scheme each module of a compressed-tensors checkpoint uses.

A config group is matched against every scheme's ``detect.compressed-tensors`` rule (format and
the arguments the rule lists, after ``normalize_arguments``). Targets follow compressed-tensors:
an exact module name, ``re:<regex>`` matched from the start of the name, or a class name
("Linear", or any name ending in "Linear": every module that stores quantized-linear tensors);
when several groups target a module the most specific wins (exact name, then regex, then class).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from qscheme.checkpoint.patterns import PREFIX as PATTERN_PREFIX
from qscheme.checkpoint.patterns import compile_entries
from qscheme.descriptor import Scheme
from qscheme.errors import CheckpointError
from qscheme.producers.base import (
    Detected,
    Entries,
    Modules,
    is_class_target,
    is_linear_class,
    looks_linear,
    looks_quantized,
    natural_key,
)
from qscheme.producers.compressed_tensors.config import CompressedTensorsConfig, ConfigGroup, block_sizes
from qscheme.producers.compressed_tensors.rule import CompressedTensorsRule, rule_of
from qscheme.text import listing

# compressed-tensors QuantizationArgs defaults, applied to what a config leaves out.
_ARGUMENT_DEFAULTS: dict[str, Any] = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False}
_IGNORED_ARGUMENTS = frozenset({"observer", "observer_kwargs"})


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
        rule = rule_of(scheme)
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


def _config_patterns(config: CompressedTensorsConfig) -> dict[str, re.Pattern[str]]:
    """Every re: target and ignore entry compiled: those read from config.json were checked and
    compiled then; a hand-built config's are checked here."""
    compiled = dict(config.patterns)
    for group in config.groups:
        compile_entries(group.targets, compiled)
    return compile_entries(config.ignore, compiled)


def detect(
    config: CompressedTensorsConfig, modules: Modules, schemes: list[Scheme], quantized_names: frozenset[str]
) -> Detected:
    compiled = _config_patterns(config)
    _refuse_groups_without_weights(config, modules, quantized_names, compiled)
    _refuse_names_of_no_module(config, modules)
    assigned: dict[str, tuple[Scheme, str]] = {}
    ignored: dict[str, str] = {}
    group_schemes: dict[str, Scheme] = {}
    used_targets: set[tuple[str, str]] = set()
    ignore = Entries.of(((None, entry) for entry in config.ignore), compiled)
    targets = Entries.of(((group, target) for group in config.groups for target in group.targets), compiled)
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
    return Detected(assigned, ignored, tuple(unused))


def _refuse_groups_without_weights(
    config: CompressedTensorsConfig,
    modules: Modules,
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
    modules: Modules,
    quantized_names: frozenset[str],
    compiled: Mapping[str, re.Pattern[str]],
) -> bool:
    """Whether a group's targets name linear layers: a linear class, or a name or regex that
    matches a module stored like a linear (a 2-D weight or quantized-linear tensors)."""
    targets = Entries.of(((None, target) for target in group.targets), compiled)
    if targets.linear_class:
        return True
    return any(
        module and looks_linear(members, quantized_names) and targets.matching(module, True)
        for module, members in modules.items()
    )


def _refuse_names_of_no_module(config: CompressedTensorsConfig, modules: Modules) -> None:
    """A target that names a module exactly must name one of the checkpoint's: otherwise the
    config and the tensors disagree on module names (transformers 5 stores vision-language models
    under other names than it runs them), and the layers it meant would silently take another
    group's scheme."""
    for group in config.groups:
        for target in group.targets:
            if target.startswith(PATTERN_PREFIX) or is_class_target(target) or target in modules:
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
        {t for group in config.groups for t in group.targets if is_class_target(t) and not is_linear_class(t)}
    )
    if not others:
        return ""
    return (
        f"; the config also targets module classes {', '.join(repr(t) for t in others)}, which qscheme does not "
        "load: only linear layers become QuantLinear (quantized embeddings and other modules are not supported)"
    )
