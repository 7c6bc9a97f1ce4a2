"""Which scheme each module of an AutoRound checkpoint uses.

AutoRound stores GPTQ's or AutoAWQ's tensors (``packing``), so a module takes the scheme whose
``detect.gptq`` or ``detect.awq`` rule matches the layout's storage format and the module's values:
the config's ``bits``, ``group_size`` and ``sym`` with its ``extra_config`` entry merged in (AWQ's
rule reads ``zero_point``: not ``sym``). A module the config leaves in floating point must not store
quantized tensors, and one that stores them must be one the config quantizes.
"""

from __future__ import annotations

from typing import Any

from qscheme.descriptor import Scheme
from qscheme.errors import CheckpointError
from qscheme.producers.auto_round.config import AutoRoundConfig
from qscheme.producers.base import Detected, Modules, looks_linear, looks_quantized
from qscheme.producers.gptq.keyed import match_scheme


def rule_values(config: AutoRoundConfig, values: dict[str, Any]) -> dict[str, Any]:
    """The values the layout's rule reads, from a module's AutoRound values."""
    if config.layout.rule == "awq":
        return {"bits": values["bits"], "group_size": values["group_size"], "zero_point": not values["sym"]}
    return {"bits": values["bits"], "group_size": values["group_size"], "sym": values["sym"]}


def detect(
    config: AutoRoundConfig, modules: Modules, schemes: list[Scheme], quantized_names: frozenset[str]
) -> Detected:
    assigned: dict[str, tuple[Scheme, str]] = {}
    ignored: dict[str, str] = {}
    chosen: dict[tuple[object, ...], Scheme] = {}
    layers = frozenset(module for module in modules if module)
    for module, members in sorted(modules.items()):
        if not module:
            continue
        quantized = looks_quantized(members, quantized_names)
        values, origin = config.module_values(module, layers)
        if values is None:
            if quantized:
                raise CheckpointError(
                    f"{config.file}: module {module} stores quantized tensors ({', '.join(sorted(members))}) but the "
                    f"config leaves it in floating point ({origin}); the config does not describe these weights: "
                    "name the layer in extra_config with its bits, or re-export"
                )
            if looks_linear(members, quantized_names):
                ignored[module] = origin
            continue
        if not quantized:
            continue
        wanted = rule_values(config, values)
        key = tuple(sorted(wanted.items()))
        if key not in chosen:
            where = f"{origin}: " if origin.startswith("extra_config") else ""
            where += f"packing_format {config.packing_format!r} ({config.layout.rule} layout): "
            chosen[key] = match_scheme(
                config.layout.rule, config.layout.storage_format, wanted, schemes, config.file, where
            )
        assigned[module] = (chosen[key], origin)
    return Detected(assigned, ignored)
