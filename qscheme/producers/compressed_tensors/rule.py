"""The ``detect.compressed-tensors`` rule of a scheme descriptor: its keys (as data, for the
descriptor's parser), the typed rule they become, and how ``qscheme show`` prints it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from qscheme.descriptor import Scheme
from qscheme.descriptor.rules import RuleKey, RuleSchema
from qscheme.producers.compressed_tensors.arguments import CHECKS, argument_problem

NAME = "compressed-tensors"


@dataclass(frozen=True)
class CompressedTensorsRule:
    """Matches a compressed-tensors config group: every listed argument must be equal."""

    formats: tuple[str, ...]
    weights: Mapping[str, Any]
    input_activations: Mapping[str, Any] | None


def rule_of(scheme: Scheme) -> CompressedTensorsRule | None:
    """The scheme's ``detect.compressed-tensors`` rule, or None."""
    rule = scheme.detect.get(NAME)
    return rule if isinstance(rule, CompressedTensorsRule) else None


def _build(values: Mapping[str, Any]) -> CompressedTensorsRule:
    return CompressedTensorsRule(
        formats=values["format"], weights=values["weights"], input_activations=values["input_activations"]
    )


def _summary(rule: CompressedTensorsRule) -> dict[str, Any]:
    return {
        "format": list(rule.formats),
        "weights": dict(rule.weights),
        "input_activations": dict(rule.input_activations) if rule.input_activations is not None else None,
    }


def _render(rule: CompressedTensorsRule) -> str:
    inputs = dict(rule.input_activations) if rule.input_activations is not None else "absent"
    return f"compressed-tensors format {'|'.join(rule.formats)}, weights {dict(rule.weights)}, inputs {inputs}"


ARGUMENTS: tuple[str, ...] = tuple(CHECKS)  # every argument key the rules may state

RULE_SCHEMA = RuleSchema(
    producer=NAME,
    keys=(
        RuleKey("format", "strings", required=True),
        RuleKey("weights", "arguments", required=True, arguments=ARGUMENTS, check=argument_problem),
        RuleKey("input_activations", "arguments", arguments=ARGUMENTS, check=argument_problem),
    ),
    build=_build,
    summary=_summary,
    render=_render,
)
