"""The ``detect.bitsandbytes`` rule of a scheme descriptor: the ``bnb_4bit_quant_type`` values it
reads (``nf4``, ``fp4``) and the config values it must equal (``double_quant``: the config's
``bnb_4bit_use_double_quant``)."""

from __future__ import annotations

from typing import Any

from qscheme.descriptor import Scheme
from qscheme.producers.gptq.keyed import KeyedRule, rule_in, rule_schema

NAME = "bitsandbytes"
FORMAT_KEY = "bnb_4bit_quant_type"
CONFIG_KEYS: tuple[str, ...] = ("double_quant",)


def _problem(key: str, value: Any) -> str | None:
    if key == "double_quant" and not isinstance(value, bool):
        return f"double_quant must be true or false, not {value!r}"
    return None


def rule_of(scheme: Scheme) -> KeyedRule | None:
    return rule_in(scheme, NAME)


RULE_SCHEMA = rule_schema(NAME, FORMAT_KEY, CONFIG_KEYS, _problem)
