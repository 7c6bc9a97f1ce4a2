"""Which modules of a self-describing checkpoint (``quant_method: qscheme``) use its scheme.

The config names no detection rule: its embedded descriptor is parsed, and every module storing
that scheme's tensors (and not in its ``ignore``: exact names, ``re:`` patterns or wildcards)
uses it, whatever the catalog holds.
"""

from __future__ import annotations

from qscheme.checkpoint.patterns import compile_entries
from qscheme.descriptor import Scheme
from qscheme.errors import CheckpointError
from qscheme.producers.base import (
    Detected,
    Modules,
    ignored_by,
    looks_linear,
    looks_quantized,
    quantized_tensor_names,
)
from qscheme.producers.self_described.config import QschemeConfig
from qscheme.text import cut

EMBEDDED_PROBLEMS_SHOWN = 20  # problems of an embedded descriptor listed in the error (then a count)


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


def detect(config: QschemeConfig, modules: Modules, schemes: list[Scheme], quantized_names: frozenset[str]) -> Detected:
    """Every module storing the embedded scheme's tensors uses it (``schemes`` and the catalog's
    ``quantized_names`` are not consulted: the embedded scheme alone decides)."""
    scheme = embedded_scheme(config)
    quantized_names = quantized_tensor_names([scheme])
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
    return Detected(assigned, ignored)
