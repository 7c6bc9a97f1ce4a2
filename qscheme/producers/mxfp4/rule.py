"""The ``detect.mxfp4`` rule of a scheme descriptor: the ``quant_method`` values it claims (as
data, for the descriptor's parser), the typed rule they become, and how ``qscheme show`` prints it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from qscheme.descriptor import Scheme
from qscheme.descriptor.rules import RuleKey, RuleSchema

NAME = "mxfp4"


@dataclass(frozen=True)
class Mxfp4Rule:
    """Matches a config.json ``quantization_config.quant_method`` (gpt-oss writes ``mxfp4``)."""

    quant_methods: tuple[str, ...]


def rule_of(scheme: Scheme) -> Mxfp4Rule | None:
    """The scheme's ``detect.mxfp4`` rule, or None."""
    rule = scheme.detect.get(NAME)
    return rule if isinstance(rule, Mxfp4Rule) else None


def _build(values: Mapping[str, Any]) -> Mxfp4Rule:
    return Mxfp4Rule(quant_methods=values["quant_method"])


def _summary(rule: Mxfp4Rule) -> dict[str, Any]:
    return {"quant_method": list(rule.quant_methods)}


def _render(rule: Mxfp4Rule) -> str:
    return f"mxfp4 quant_method {'|'.join(rule.quant_methods)}"


RULE_SCHEMA = RuleSchema(
    producer=NAME,
    keys=(RuleKey("quant_method", "strings", required=True),),
    build=_build,
    summary=_summary,
    render=_render,
)
