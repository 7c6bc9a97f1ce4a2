"""Which modules of an ``fp8`` checkpoint are FP8-block layers, and their scheme.

The config names no module: every module that stores quantized tensors (an e4m3 ``weight``, a
``weight_scale_inv``, ...) takes the one scheme whose ``detect.fp8`` rule names the config's
``scale_fmt`` and ``activation_scheme`` and whose ``weight.scale.block`` equals its
``weight_block_size``; a module storing a 16-bit weight and nothing else is a plain layer.
``modules_to_not_convert`` entries match as transformers matches them (``should_convert_module``):
from the start of the name up to a module boundary (as a regular expression), or as a suffix of
the name. A skipped module that stores quantized tensors is refused.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from qscheme.checkpoint.patterns import PREFIX, compile_pattern
from qscheme.descriptor import Scheme
from qscheme.errors import CheckpointError
from qscheme.producers.base import Detected, Modules, looks_linear, looks_quantized
from qscheme.producers.fp8.config import Fp8Config
from qscheme.producers.fp8.rule import rule_of

_BOUNDARY = r"(?:(?<=\.)|(?=\.|$))"  # a match ends at a module boundary: "layers.1" is not "layers.11"


def match_fp8_scheme(config: Fp8Config, schemes: Iterable[Scheme]) -> Scheme:
    """The scheme for the config's scale_fmt, activation_scheme and weight_block_size."""
    ruled = [(scheme, rule) for scheme in schemes if (rule := rule_of(scheme)) is not None]
    candidates = [
        scheme
        for scheme, rule in ruled
        if config.scale_fmt in rule.scale_fmts and config.activation_scheme in rule.activation_schemes
    ]
    where = f"{config.file}: quantization_config"
    if not candidates:
        known = ", ".join(f"{s.name} ({', '.join(r.scale_fmts)})" for s, r in ruled) or "none"
        raise CheckpointError(
            f"{where}: scale_fmt {config.scale_fmt!r} with activation_scheme {config.activation_scheme!r} matches no "
            f"scheme's detect.fp8 rule (known: {known}); add a scheme descriptor with detect.fp8.scale_fmt: "
            f"{config.scale_fmt} (docs/schemes.md)"
        )
    block = config.weight_block_size
    fitting = [s for s in candidates if s.weight.scale.granularity == "block" and s.weight.scale.block == block]
    if not fitting:
        declared = ", ".join(f"{s.name}: {_block_text(s.weight.scale.block)}" for s in candidates)
        raise CheckpointError(
            f"{where}.weight_block_size is {list(block)}, but the fp8 schemes for scale_fmt {config.scale_fmt!r} "
            f"declare other blocks ({declared}); these tensors cannot be read with them. Add a scheme descriptor with "
            f"weight.scale.block: {list(block)} and detect.fp8.scale_fmt: {config.scale_fmt} (docs/schemes.md)"
        )
    if len(fitting) > 1:
        raise CheckpointError(
            f"{where}: scale_fmt {config.scale_fmt!r} and weight_block_size {list(block)} match several schemes: "
            f"{', '.join(s.name for s in fitting)}; make their detect rules distinct"
        )
    return fitting[0]


def _block_text(block: tuple[int, int] | None) -> str:
    return f"{block[0]}x{block[1]}" if block is not None else "no blocks"


def skip_patterns(config: Fp8Config) -> list[tuple[str, re.Pattern[str]]]:
    """Each ``modules_to_not_convert`` entry and its pattern, checked for catastrophic backtracking."""
    return [
        (
            entry,
            compile_pattern(
                f"{PREFIX}(?:{entry}){_BOUNDARY}", f"{config.file}: quantization_config.modules_to_not_convert[{i}]"
            ),
        )
        for i, entry in enumerate(config.modules_to_not_convert)
    ]


def skipped_by(module: str, patterns: list[tuple[str, re.Pattern[str]]]) -> str | None:
    """The first entry that skips ``module`` (transformers' should_convert_module), or None."""
    for entry, pattern in patterns:
        if pattern.match(module) or module.endswith(entry):
            return entry
    return None


def detect(config: Fp8Config, modules: Modules, schemes: list[Scheme], quantized_names: frozenset[str]) -> Detected:
    scheme = match_fp8_scheme(config, schemes)
    patterns = skip_patterns(config)
    origin = (
        f"quant_method fp8, weight_block_size {list(config.weight_block_size)}, scale_fmt {config.scale_fmt} "
        f"(scheme {scheme.name})"
    )
    assigned: dict[str, tuple[Scheme, str]] = {}
    ignored: dict[str, str] = {}
    for module, members in sorted(modules.items()):
        if not module:
            continue
        quantized = looks_quantized(members, quantized_names)
        entry = skipped_by(module, patterns) if patterns else None
        if entry is not None:
            if quantized:
                raise CheckpointError(
                    f"{config.file}: module {module} is in quantization_config.modules_to_not_convert ({entry!r}) but "
                    f"stores quantized tensors ({', '.join(sorted(members))}); the config does not describe these "
                    "weights: remove the entry, or store the module's weight in 16 bits"
                )
            if looks_linear(members, quantized_names):
                ignored[module] = entry
            continue
        if quantized:
            assigned[module] = (scheme, origin)
    return Detected(assigned, ignored)
