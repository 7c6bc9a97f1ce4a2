"""The ``detect.awq`` rule of a scheme descriptor: the ``version`` values (packings) it reads and
the config values it must equal (``bits``, ``group_size``, ``zero_point``)."""

from __future__ import annotations

from typing import Any

from qscheme.descriptor import Scheme
from qscheme.producers.gptq.keyed import KeyedRule, rule_in, rule_schema

NAME = "awq"
CONFIG_KEYS: tuple[str, ...] = ("bits", "group_size", "zero_point")


def _problem(key: str, value: Any) -> str | None:
    if key == "bits" and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 8):
        return f"bits must be an integer from 1 to 8, not {value!r}"
    if key == "group_size" and (isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1)):
        return f"group_size must be a positive integer or -1, not {value!r}"
    if key == "zero_point" and not isinstance(value, bool):
        return f"zero_point must be true or false, not {value!r}"
    return None


def rule_of(scheme: Scheme) -> KeyedRule | None:
    return rule_in(scheme, NAME)


RULE_SCHEMA = rule_schema(NAME, "version", CONFIG_KEYS, _problem)
