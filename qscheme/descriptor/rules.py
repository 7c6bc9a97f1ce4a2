"""A descriptor's ``detect`` block, producer by producer, parsed from data the producers declare.

``detect.<producer>`` holds the rule by which a producer's config is matched to the scheme. The
descriptor knows no producer: each producer folder declares its rule as a ``RuleSchema`` (its
keys, each with a kind and the values it accepts, and how the parsed values become the
producer's own typed rule), and ``qscheme.producers`` hands these schemas to
``register_rule_schema`` when it is imported (the top package ``qscheme``, which runs before any
of its modules, imports it, so a descriptor is never parsed before). The parser
(``descriptor.parse``) reads ``detect.<name>`` and the ``producer:`` / ``rules:`` keys against
this table, with the same located problems as any other key; ``show`` asks the schema how to
print the rule.

Kinds of keys: ``strings`` (a string or a list of them), ``integer`` (an integer >= 1) and
``arguments`` (a mapping whose keys are ``RuleKey.arguments``, each value checked by
``RuleKey.check``, which returns what is wrong or None).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

RuleKind = Literal["strings", "integer", "arguments"]


@dataclass(frozen=True)
class RuleKey:
    """One key of a ``detect.<producer>`` rule."""

    name: str
    kind: RuleKind
    required: bool = False
    arguments: tuple[str, ...] = ()
    check: Callable[[str, Any], str | None] | None = None


@dataclass(frozen=True)
class RuleSchema:
    """A producer's ``detect.<producer>`` rule: its keys (in the order they are read), how the
    parsed values (key -> value, absent optional keys as None) become the producer's typed rule,
    and how ``qscheme show`` prints it (``summary``: its JSON; ``render``: the text after
    ``detect:``)."""

    producer: str
    keys: tuple[RuleKey, ...]
    build: Callable[[Mapping[str, Any]], Any]
    summary: Callable[[Any], dict[str, Any]]
    render: Callable[[Any], str]

    @property
    def required(self) -> tuple[str, ...]:
        return tuple(key.name for key in self.keys if key.required)

    @property
    def optional(self) -> tuple[str, ...]:
        return tuple(key.name for key in self.keys if not key.required)


_SCHEMAS: dict[str, RuleSchema] = {}


def register_rule_schema(schema: RuleSchema) -> None:
    """Add a producer's rule schema (``qscheme.producers`` does, for each producer that has one)."""
    known = _SCHEMAS.get(schema.producer)
    if known is not None and known is not schema:
        raise ValueError(f"a detect rule for producer {schema.producer!r} is already registered")
    _SCHEMAS[schema.producer] = schema


def rule_schemas() -> tuple[RuleSchema, ...]:
    """The registered rule schemas, in the order their producers are registered."""
    return tuple(_SCHEMAS.values())


def rule_producers() -> tuple[str, ...]:
    """The producers a descriptor may name (``producer:``, ``rules:``, ``detect.<name>``)."""
    return tuple(_SCHEMAS)


@dataclass(frozen=True)
class DetectSpec:
    """A scheme's detect rules: producer name -> that producer's typed rule (see ``RuleSchema``).

    ``detect.get("modelopt")`` is the rule or None. The attribute spelling
    ``detect.compressed_tensors`` (the name with '_' for '-') reads the same, as before producers
    declared their own rules.
    """

    rules: Mapping[str, Any] = field(default_factory=dict)

    def get(self, producer: str) -> Any:
        return self.rules.get(producer)

    def __contains__(self, producer: object) -> bool:
        return producer in self.rules

    def __iter__(self) -> Iterator[str]:
        return iter(self.rules)

    def __hash__(self) -> int:
        return hash(tuple(self.rules.items()))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "rules":
            raise AttributeError(name)
        return self.rules.get(name.replace("_", "-"))
