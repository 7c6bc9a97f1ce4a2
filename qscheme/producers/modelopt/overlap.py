"""ModelOpt detect rules that claim the same quant_algo (for ``qscheme validate``).

Rules that name the same quant_algo are ambiguous for a config that gives the group size both
give, or gives none while neither or both rules give one (a rule with no group size takes such a
config alone); the loader's own ``match_modelopt_algo`` decides.
"""

from __future__ import annotations

from qscheme.descriptor import Scheme
from qscheme.errors import CheckpointError
from qscheme.producers.modelopt.detect import match_modelopt_algo
from qscheme.producers.modelopt.rule import rule_of

FIX = "give the rules different quant_algo names or group_size values, or remove one of them"


def witness(a: Scheme, b: Scheme) -> tuple[str, None] | None:
    """The config (a quant_algo and group size) both schemes' rules match; None when there is none."""
    text = _modelopt_witness(a, b)
    return None if text is None else (text, None)


def _modelopt_witness(a: Scheme, b: Scheme) -> str | None:
    rule, other = rule_of(a), rule_of(b)
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
