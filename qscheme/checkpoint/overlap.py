"""Detect rules that claim the same producer config: loading such a config would be ambiguous.

Detection has no precedence between schemes: a compressed-tensors config group or a ModelOpt
quant_algo that two schemes' rules match is refused at load ("matches several schemes"). This
module finds such pairs ahead of time, for ``qscheme validate``, by building a witness: the
config the two rules would both match, run through the loader's own matchers
(``detect.rule_differences`` and ``detect.match_modelopt_algo``), so the answer is the loader's.

compressed-tensors: a rule matches a group when the group's format is one of the rule's and
every argument the rule lists equals the group's (after normalisation). Two rules can both
match a group when their formats share one, both or neither quantize input activations, and
the arguments both list agree; the witness is the union of their arguments.

ModelOpt: rules that name the same quant_algo are ambiguous for a config that gives the group
size both give, or gives none while neither or both rules give one (a rule with no group size
takes such a config alone).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from qscheme.checkpoint.config import ConfigGroup
from qscheme.checkpoint.detect import match_modelopt_algo, rule_differences
from qscheme.descriptor import CompressedTensorsRule, Scheme
from qscheme.errors import CheckpointError


@dataclass(frozen=True)
class Overlap:
    """Two schemes whose rules for one producer both match ``witness``."""

    producer: str  # the ``detect`` key: "compressed-tensors" or "modelopt"
    first: str
    second: str
    witness: str  # the config both match, as a producer writes it
    group: ConfigGroup | None = None  # that config group, for a compressed-tensors overlap


def overlaps(scheme: Scheme, others: Iterable[Scheme]) -> list[Overlap]:
    """Every rule of ``scheme`` that also matches what a rule of one of ``others`` matches
    (schemes named like ``scheme`` are skipped: the name check reports those)."""
    found: list[Overlap] = []
    for other in others:
        if other.name == scheme.name:
            continue
        group = _compressed_tensors_witness(scheme.detect.compressed_tensors, other.detect.compressed_tensors)
        if group is not None:
            found.append(Overlap("compressed-tensors", scheme.name, other.name, _describe(group), group))
        witness = _modelopt_witness(scheme, other)
        if witness is not None:
            found.append(Overlap("modelopt", scheme.name, other.name, witness))
    return found


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


def _modelopt_witness(a: Scheme, b: Scheme) -> str | None:
    rule, other = a.detect.modelopt, b.detect.modelopt
    if rule is None or other is None:
        return None
    others = {algo.upper() for algo in other.quant_algos}
    sizes = dict.fromkeys((rule.group_size, other.group_size, None))  # a config may give no group size
    for algo in rule.quant_algos:
        for size in sizes if algo.upper() in others else ():
            if _ambiguous(algo, size, a, b):
                return f"quant_algo {algo!r}" + (f", group_size {size}" if size is not None else ", no group_size")
    return None


def _ambiguous(algo: str, group_size: int | None, a: Scheme, b: Scheme) -> bool:
    """The loader takes ``algo`` (with ``group_size``) for each scheme alone but not for both."""
    try:
        match_modelopt_algo(algo, group_size, [a], "", "")
        match_modelopt_algo(algo, group_size, [b], "", "")
    except CheckpointError:
        return False
    try:
        match_modelopt_algo(algo, group_size, [a, b], "", "")
    except CheckpointError:
        return True
    return False


def _union(low: Mapping[str, Any], high: Mapping[str, Any]) -> dict[str, Any]:
    """``low``'s arguments updated with ``high``'s."""
    return {**low, **high}


def _json(arguments: Mapping[str, Any] | None) -> str:
    return json.dumps(dict(arguments or {}), sort_keys=True)
