"""Which scheme each module of an AWQ checkpoint uses: every module storing quantized tensors takes
the scheme whose ``detect.awq`` rule matches the config's ``version``, ``bits``, ``group_size`` and
``zero_point``; a module named by ``modules_to_not_convert`` must not store any."""

from __future__ import annotations

from qscheme.descriptor import Scheme
from qscheme.errors import CheckpointError
from qscheme.producers.awq.config import AwqConfig
from qscheme.producers.awq.rule import NAME
from qscheme.producers.base import Detected, Modules, looks_linear, looks_quantized
from qscheme.producers.gptq.keyed import match_scheme


def detect(config: AwqConfig, modules: Modules, schemes: list[Scheme], quantized_names: frozenset[str]) -> Detected:
    assigned: dict[str, tuple[Scheme, str]] = {}
    ignored: dict[str, str] = {}
    scheme: Scheme | None = None
    origin = f"awq {config.version} bits {config.bits}, group_size {config.group_size}"
    for module, members in sorted(modules.items()):
        if not module:
            continue
        quantized = looks_quantized(members, quantized_names)
        entry = config.not_converted_by(module)
        if entry is not None:
            if quantized:
                raise CheckpointError(
                    f"{config.file}: module {module} is in modules_to_not_convert ({entry!r}) but stores quantized "
                    f"tensors ({', '.join(sorted(members))}); the config does not describe these weights"
                )
            if looks_linear(members, quantized_names):
                ignored[module] = f"modules_to_not_convert {entry!r}"
            continue
        if not quantized:
            continue
        if scheme is None:
            scheme = match_scheme(NAME, config.version, config.values(), schemes, config.file, "")
        assigned[module] = (scheme, origin)
    return Detected(assigned, ignored)
