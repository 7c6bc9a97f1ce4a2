"""Which scheme each module of a ModelOpt checkpoint uses.

The config's ``quant_algo`` (or, for a mixed-precision export, each layer's in
``quantized_layers``) is matched against every scheme's ``detect.modelopt`` rule, with its group
size. ``exclude_modules`` and ``ignore`` entries are fnmatch wildcards.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

from qscheme.descriptor import Scheme
from qscheme.errors import CheckpointError
from qscheme.producers.base import Detected, Modules, looks_linear, looks_quantized
from qscheme.producers.modelopt.config import ModeloptConfig
from qscheme.producers.modelopt.rule import rule_of


def match_modelopt_algo(
    quant_algo: str, group_size: int | None, schemes: Iterable[Scheme], file: str, where: str
) -> Scheme:
    """The scheme whose ModelOpt rule names ``quant_algo`` (case-insensitive)."""
    import difflib

    known: dict[str, list[Scheme]] = {}
    for scheme in schemes:
        rule = rule_of(scheme)
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
        if rule_of(s) is not None and (_group_size(s) is None or group_size is None or _group_size(s) == group_size)
    ]
    if not fitting:
        sizes = ", ".join(f"{s.name}: group {_group_size(s)}" for s in candidates if rule_of(s))
        raise CheckpointError(
            f"{file}: {where}quant_algo {quant_algo!r} with group_size {group_size} matches no scheme ({sizes})"
        )
    if len(fitting) > 1:
        exact = [s for s in fitting if rule_of(s) is not None and _group_size(s) == group_size]
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


def detect(
    config: ModeloptConfig, modules: Modules, schemes: list[Scheme], quantized_names: frozenset[str]
) -> Detected:
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
    return Detected(assigned, ignored)


def _group_size(scheme: Scheme) -> int | None:
    rule = rule_of(scheme)
    return rule.group_size if rule is not None else None
