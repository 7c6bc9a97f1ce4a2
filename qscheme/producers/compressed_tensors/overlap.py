"""compressed-tensors detect rules that claim the same config group (for ``qscheme validate``).

A rule matches a group when the group's format is one of the rule's and every argument the rule
lists equals the group's (after normalisation). Two rules can both match a group when their
formats share one, both or neither quantize input activations, and the arguments both list
agree; the witness is the union of their arguments, checked with the loader's own
``rule_differences``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from qscheme.descriptor import Scheme
from qscheme.producers.compressed_tensors.config import ConfigGroup
from qscheme.producers.compressed_tensors.detect import rule_differences
from qscheme.producers.compressed_tensors.rule import CompressedTensorsRule, rule_of

FIX = "make one rule more specific (list an argument the other lists, with another value) or remove one of them"


def witness(a: Scheme, b: Scheme) -> tuple[str, ConfigGroup] | None:
    """The config group both schemes' rules match, described and built; None when there is none."""
    group = _compressed_tensors_witness(rule_of(a), rule_of(b))
    return None if group is None else (_describe(group), group)


def _compressed_tensors_witness(a: CompressedTensorsRule | None, b: CompressedTensorsRule | None) -> ConfigGroup | None:
    if a is None or b is None:
        return None
    shared = [fmt for fmt in a.formats if fmt in b.formats]
    if not shared or (a.input_activations is None) != (b.input_activations is None):
        return None
    group = ConfigGroup(
        name="group_0",
        targets=("Linear",),
        weights=_union(b.weights, a.weights),
        input_activations=None
        if a.input_activations is None or b.input_activations is None
        else _union(b.input_activations, a.input_activations),
        output_activations=None,
        format=shared[0],
    )
    if rule_differences(a, group, None)[1] or rule_differences(b, group, None)[1]:
        return None  # an argument both list differs
    return group


def _describe(group: ConfigGroup) -> str:
    text = f"format {group.format!r}, weights {_json(group.weights)}"
    if group.input_activations is not None:
        text += f", input_activations {_json(group.input_activations)}"
    return text


def _union(low: Mapping[str, Any], high: Mapping[str, Any]) -> dict[str, Any]:
    """``low``'s arguments updated with ``high``'s."""
    return {**low, **high}


def _json(arguments: Mapping[str, Any] | None) -> str:
    return json.dumps(dict(arguments or {}), sort_keys=True)
