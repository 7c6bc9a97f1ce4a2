"""The ``detect.gptq`` rule of a scheme descriptor: the ``checkpoint_format`` values it reads
(``gptq``, ``gptq_v2``) and the config values it must equal (``bits``, ``group_size``, ``sym``)."""

from __future__ import annotations

from typing import Any

from qscheme.descriptor import Scheme
from qscheme.producers.gptq.keyed import KeyedRule, rule_in, rule_schema

NAME = "gptq"
CONFIG_KEYS: tuple[str, ...] = ("bits", "group_size", "sym")


def _problem(key: str, value: Any) -> str | None:
    if key == "bits" and value not in (2, 3, 4, 8):
        return f"bits must be 2, 3, 4 or 8, not {value!r}"
    if key == "group_size" and (isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1)):
        return f"group_size must be a positive integer or -1 (one scale per output channel), not {value!r}"
    if key == "sym" and not isinstance(value, bool):
        return f"{key} must be true or false, not {value!r}"
    return None


def rule_of(scheme: Scheme) -> KeyedRule | None:
    return rule_in(scheme, NAME)


RULE_SCHEMA = rule_schema(NAME, "checkpoint_format", CONFIG_KEYS, _problem)
