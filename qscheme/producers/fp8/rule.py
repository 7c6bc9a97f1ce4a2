"""The ``detect.fp8`` rule of a scheme descriptor: its keys (as data, for the descriptor's parser),
the typed rule they become, and how ``qscheme show`` prints it.

The block size is not part of the rule: a config's ``weight_block_size`` must equal the scheme's
own ``weight.scale.block``, so another block size is another YAML file, not another rule key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from qscheme.descriptor import Scheme
from qscheme.descriptor.rules import RuleKey, RuleSchema

NAME = "fp8"
SCALE_FORMATS = ("float", "ue8m0")  # the config's scale_fmt values transformers' FineGrainedFP8Config takes


@dataclass(frozen=True)
class Fp8Rule:
    """Matches an ``fp8`` config by its ``scale_fmt`` and ``activation_scheme`` (and, through the
    scheme, its ``weight_block_size``)."""

    scale_fmts: tuple[str, ...]
    activation_schemes: tuple[str, ...] = ("dynamic",)


def rule_of(scheme: Scheme) -> Fp8Rule | None:
    """The scheme's ``detect.fp8`` rule, or None."""
    rule = scheme.detect.get(NAME)
    return rule if isinstance(rule, Fp8Rule) else None


def _build(values: Mapping[str, Any]) -> Fp8Rule:
    return Fp8Rule(
        scale_fmts=tuple(values["scale_fmt"]),
        activation_schemes=tuple(values["activation_scheme"] or ("dynamic",)),
    )


def _summary(rule: Fp8Rule) -> dict[str, Any]:
    return {"scale_fmt": list(rule.scale_fmts), "activation_scheme": list(rule.activation_schemes)}


def _render(rule: Fp8Rule) -> str:
    return (
        f"fp8 scale_fmt {'|'.join(rule.scale_fmts)}, activation_scheme {'|'.join(rule.activation_schemes)}, "
        "weight_block_size = weight.scale.block"
    )


RULE_SCHEMA = RuleSchema(
    producer=NAME,
    keys=(
        RuleKey("scale_fmt", "strings", required=True),
        RuleKey("activation_scheme", "strings"),
    ),
    build=_build,
    summary=_summary,
    render=_render,
)
