"""AWQ's config.json ``quantization_config`` for a scheme with a ``detect.awq`` rule, as AutoAWQ's
``to_transformers_dict`` writes it; modules left in 16 bits are named in ``modules_to_not_convert``
(AutoAWQ skips every module whose name contains an entry)."""

from __future__ import annotations

from typing import Any

from qscheme.descriptor import Scheme
from qscheme.producers.awq.rule import rule_of
from qscheme.producers.base import WriteRequest


def writes(scheme: Scheme) -> bool:
    return rule_of(scheme) is not None


def write_config(request: WriteRequest) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    rule = rule_of(request.scheme)
    assert rule is not None
    return {
        "quant_method": "awq",
        "zero_point": rule.values.get("zero_point", True),
        "group_size": rule.values.get("group_size"),
        "bits": rule.values.get("bits"),
        "version": rule.formats[0],
        "modules_to_not_convert": list(request.unquantized_modules) or None,
    }, {}
