"""GPTQ's config.json ``quantization_config`` for a scheme with a ``detect.gptq`` rule, as
GPTQModel writes it: ``quant_method: gptq``, ``bits``, ``group_size``, ``sym``, ``desc_act``
(qscheme keeps columns in order: false), ``checkpoint_format`` (and GPTQModel's ``format``) and
``pack_dtype``; modules left in 16 bits get a ``-:`` entry of ``dynamic`` each."""

from __future__ import annotations

import re
from typing import Any

from qscheme.descriptor import Scheme
from qscheme.producers.base import WriteRequest
from qscheme.producers.gptq.rule import rule_of


def writes(scheme: Scheme) -> bool:
    return rule_of(scheme) is not None


def write_config(request: WriteRequest) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    rule = rule_of(request.scheme)
    assert rule is not None
    section: dict[str, Any] = {
        "quant_method": "gptq",
        "bits": rule.values.get("bits"),
        "group_size": rule.values.get("group_size"),
        "sym": rule.values.get("sym", True),
        "desc_act": False,
        "checkpoint_format": rule.formats[0],
        "format": rule.formats[0],
        "pack_dtype": "int32",
    }
    if request.unquantized_modules:
        section["dynamic"] = {f"-:^{re.escape(module)}$": {} for module in request.unquantized_modules}
    return section, {}
