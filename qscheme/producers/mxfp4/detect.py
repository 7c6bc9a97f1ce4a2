"""Which scheme each module of a gpt-oss MXFP4 checkpoint uses.

The loader has already split each stacked experts tensor into one module per expert and
projection (``<experts>.<e>.gate_up_proj``: see ``STACKED_EXPERTS`` and
``checkpoint.stacked_experts``). Those modules take the scheme whose ``detect.mxfp4`` rule names the
config's ``quant_method``. gpt-oss quantizes nothing else: a module outside the stacked experts
that stores quantized tensors, or one that ``modules_to_not_convert`` names, is refused.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable

from qscheme.descriptor import Scheme
from qscheme.errors import CheckpointError
from qscheme.producers.base import Detected, Modules, StackedExperts, looks_linear, looks_quantized
from qscheme.producers.mxfp4.config import Mxfp4Config
from qscheme.producers.mxfp4.rule import rule_of

STACKED_EXPERTS = StackedExperts(
    projections=("gate_up_proj", "down_proj"),
    separator="_",
    folded={"blocks": 16},
    members={"gate_up_proj": ("gate_proj", "up_proj")},
    interleaved=True,
)
"""gpt-oss's storage: ``<experts>.gate_up_proj_blocks`` uint8 [E, R, C/32, 16] (each expert's
[R, C/2] codes, 32 codes in 16 bytes per scale), ``_scales`` uint8 [E, R, C/32], ``_bias`` [E, R].
The gate_up_proj rows alternate gate (even) and up (odd), as transformers' GptOssExperts reads them."""


def scheme_for(method: str, schemes: Iterable[Scheme], file: str) -> Scheme:
    """The one scheme whose ``detect.mxfp4`` rule names ``method``."""
    matching = [s for s in schemes if (rule := rule_of(s)) is not None and method in rule.quant_methods]
    if len(matching) == 1:
        return matching[0]
    if not matching:
        raise CheckpointError(
            f"{file}: quantization_config.quant_method {method!r}: no scheme's detect.mxfp4 rule names it; add a "
            f"scheme descriptor with detect: {{mxfp4: {{quant_method: {method}}}}} (see docs/schemes.md)"
        )
    raise CheckpointError(
        f"{file}: quantization_config.quant_method {method!r} matches several schemes: "
        f"{', '.join(s.name for s in matching)}; make their detect.mxfp4 rules distinct"
    )


def _not_converted(module: str, patterns: Iterable[str]) -> str | None:
    """The ``modules_to_not_convert`` entry naming ``module`` or a module above it."""
    parts = module.split(".")
    prefixes = [".".join(parts[:end]) for end in range(len(parts), 0, -1)]
    return next((p for p in patterns for prefix in prefixes if fnmatch.fnmatchcase(prefix, p)), None)


def detect(config: Mxfp4Config, modules: Modules, schemes: list[Scheme], quantized_names: frozenset[str]) -> Detected:
    expert = re.compile(r".+\.[0-9]+\.(?:" + "|".join(map(re.escape, STACKED_EXPERTS.projections)) + r")\Z")
    assigned: dict[str, tuple[Scheme, str]] = {}
    ignored: dict[str, str] = {}
    scheme: Scheme | None = None
    for module, members in sorted(modules.items()):
        if not module:
            continue
        quantized = looks_quantized(members, quantized_names)
        entry = _not_converted(module, config.modules_to_not_convert)
        if entry is not None:
            if quantized:
                raise CheckpointError(
                    f"{config.file}: module {module} is in modules_to_not_convert ({entry!r}) but stores quantized "
                    f"tensors ({', '.join(sorted(members))}); the config does not describe these weights"
                )
            if looks_linear(members, quantized_names):
                ignored[module] = entry
            continue
        if not quantized:
            continue
        if expert.match(module) is None:
            raise CheckpointError(
                f"{config.file}: module {module} stores quantized tensors ({', '.join(sorted(members))}), but an "
                "mxfp4 (gpt-oss) checkpoint quantizes only MoE experts, stored stacked as "
                "<experts>.gate_up_proj_blocks / _scales / _bias and down_proj_*; re-export the checkpoint, or "
                "name the module in modules_to_not_convert with bf16 weights"
            )
        scheme = scheme or scheme_for(config.quant_method, schemes, config.file)
        assigned[module] = (scheme, f"quant_method {config.quant_method}")
    return Detected(assigned, ignored)
