"""Which scheme each module of a GPTQ checkpoint uses.

Every module that stores quantized tensors (``qweight``, ``qzeros``, ...) takes the scheme whose
``detect.gptq`` rule matches the config's ``checkpoint_format`` and its values for that module (the
config's ``bits``, ``group_size`` and ``sym``, with the first matching ``dynamic`` override merged
in). A module a ``-:`` override leaves unquantized must not store quantized tensors.
"""

from __future__ import annotations

from qscheme.descriptor import Scheme
from qscheme.errors import CheckpointError
from qscheme.producers.base import Detected, Modules, looks_linear, looks_quantized
from qscheme.producers.gptq.config import GptqConfig
from qscheme.producers.gptq.keyed import match_scheme
from qscheme.producers.gptq.rule import NAME


def detect(config: GptqConfig, modules: Modules, schemes: list[Scheme], quantized_names: frozenset[str]) -> Detected:
    assigned: dict[str, tuple[Scheme, str]] = {}
    ignored: dict[str, str] = {}
    chosen: dict[tuple[object, ...], Scheme] = {}
    for module, members in sorted(modules.items()):
        if not module:
            continue
        quantized = looks_quantized(members, quantized_names)
        values, origin = config.module_values(module)
        if values is None:
            if quantized:
                raise CheckpointError(
                    f"{config.file}: module {module} is left unquantized by {origin} but stores quantized tensors "
                    f"({', '.join(sorted(members))}); the config does not describe these weights: fix the "
                    "dynamic entry or re-export"
                )
            if looks_linear(members, quantized_names):
                ignored[module] = origin
            continue
        if not quantized:
            continue
        key = tuple(sorted(values.items()))
        if key not in chosen:
            where = f"{origin}: " if origin.startswith("dynamic") else ""
            chosen[key] = match_scheme(NAME, config.checkpoint_format, values, schemes, config.file, where)
        assigned[module] = (chosen[key], origin)
    return Detected(assigned, ignored)
