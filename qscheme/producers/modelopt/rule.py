"""The ``detect.modelopt`` rule of a scheme descriptor: its keys (as data, for the descriptor's
parser), the typed rule they become, and how ``qscheme show`` prints it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from qscheme.descriptor import Scheme
from qscheme.descriptor.rules import RuleKey, RuleSchema

NAME = "modelopt"


@dataclass(frozen=True)
class ModeloptRule:
    """Matches a ModelOpt quant_algo (case-insensitive), optionally a group size."""

    quant_algos: tuple[str, ...]
    group_size: int | None = None


def rule_of(scheme: Scheme) -> ModeloptRule | None:
    """The scheme's ``detect.modelopt`` rule, or None."""
    rule = scheme.detect.get(NAME)
    return rule if isinstance(rule, ModeloptRule) else None


def _build(values: Mapping[str, Any]) -> ModeloptRule:
    return ModeloptRule(quant_algos=values["quant_algo"], group_size=values["group_size"])


def _summary(rule: ModeloptRule) -> dict[str, Any]:
    return {"quant_algo": list(rule.quant_algos), "group_size": rule.group_size}


def _render(rule: ModeloptRule) -> str:
    return f"modelopt quant_algo {'|'.join(rule.quant_algos)}"


RULE_SCHEMA = RuleSchema(
    producer=NAME,
    keys=(RuleKey("quant_algo", "strings", required=True), RuleKey("group_size", "integer")),
    build=_build,
    summary=_summary,
    render=_render,
)
