"""Detection shared by producers whose config is one flat set of keys (GPTQ, AWQ): a scheme's
rule names the storage format (GPTQ's ``checkpoint_format``, AWQ's ``version``) and the config
values it must equal (``bits``, ``group_size``, ``sym``, ...), and a module's effective values
(the config's, with any per-module override merged in) pick exactly one scheme."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from qscheme.descriptor import Scheme
from qscheme.descriptor.rules import RuleKey, RuleSchema
from qscheme.errors import CheckpointError


@dataclass(frozen=True)
class KeyedRule:
    """Matches a config whose storage format is one of ``formats`` and whose values equal ``values``."""

    format_key: str
    formats: tuple[str, ...]
    values: Mapping[str, Any]

    def __hash__(self) -> int:
        return hash((self.format_key, self.formats, tuple(sorted(self.values.items()))))

    def matches(self, storage_format: str, values: Mapping[str, Any]) -> bool:
        return storage_format in self.formats and all(values.get(key) == value for key, value in self.values.items())

    def describe(self) -> str:
        shown = ", ".join(f"{key} {value!r}" for key, value in self.values.items())
        return f"{self.format_key} {'|'.join(self.formats)}" + (f", {shown}" if shown else "")


ValueCheck = Callable[[str, Any], "str | None"]


def rule_schema(producer: str, format_key: str, value_keys: tuple[str, ...], check: ValueCheck) -> RuleSchema:
    """The ``detect.<producer>`` rule: ``<format_key>`` (one or several strings, required) and
    ``config`` (the config values to equal: any of ``value_keys``)."""

    def build(values: Mapping[str, Any]) -> KeyedRule:
        return KeyedRule(format_key, tuple(values[format_key]), dict(values["config"] or {}))

    def summary(rule: KeyedRule) -> dict[str, Any]:
        return {format_key: list(rule.formats), "config": dict(rule.values)}

    def render(rule: KeyedRule) -> str:
        return f"{producer} {rule.describe()}"

    return RuleSchema(
        producer=producer,
        keys=(
            RuleKey(format_key, "strings", required=True),
            RuleKey("config", "arguments", required=True, arguments=value_keys, check=check),
        ),
        build=build,
        summary=summary,
        render=render,
    )


def rule_in(scheme: Scheme, producer: str) -> KeyedRule | None:
    rule = scheme.detect.get(producer)
    return rule if isinstance(rule, KeyedRule) else None


def match_scheme(
    producer: str,
    storage_format: str,
    values: Mapping[str, Any],
    schemes: Iterable[Scheme],
    file: str,
    where: str,
) -> Scheme:
    """The one scheme whose ``detect.<producer>`` rule matches; CheckpointError naming the config
    values and the rules known otherwise."""
    ruled = [(scheme, rule) for scheme in schemes if (rule := rule_in(scheme, producer)) is not None]
    fitting = [scheme for scheme, rule in ruled if rule.matches(storage_format, values)]
    stated = ", ".join(f"{key} {value!r}" for key, value in values.items())
    format_key = ruled[0][1].format_key if ruled else "format"
    if len(fitting) == 1:
        return fitting[0]
    if len(fitting) > 1:
        raise CheckpointError(
            f"{file}: {where}{format_key} {storage_format!r} with {stated} matches several schemes: "
            f"{', '.join(s.name for s in fitting)}; make their detect.{producer} rules distinct"
        )
    known = "; ".join(f"{scheme.name}: {rule.describe()}" for scheme, rule in ruled) or "none"
    raise CheckpointError(
        f"{file}: {where}{format_key} {storage_format!r} with {stated} matches no scheme; qscheme reads "
        f"({known}). Add a scheme descriptor with detect.{producer} naming these values (see docs/schemes.md)"
    )


def overlap_witness(producer: str) -> Callable[[Scheme, Scheme], tuple[str, None] | None]:
    """Two rules overlap when they share a storage format and no key both state differs."""

    def witness(a: Scheme, b: Scheme) -> tuple[str, None] | None:
        rule, other = rule_in(a, producer), rule_in(b, producer)
        if rule is None or other is None:
            return None
        shared = [fmt for fmt in rule.formats if fmt in other.formats]
        if not shared:
            return None
        if any(key in other.values and other.values[key] != value for key, value in rule.values.items()):
            return None
        merged = {**rule.values, **other.values}
        stated = ", ".join(f"{key} {value!r}" for key, value in merged.items())
        return f"{rule.format_key} {shared[0]!r}" + (f", {stated}" if stated else ""), None

    return witness


OVERLAP_FIX = "give the rules different formats or config values, or remove one of them"


def boolean(file: str, path: str, items: Mapping[str, Any], key: str, default: bool) -> bool:
    value = items.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise CheckpointError(f"{file}: {path}.{key}: expected true or false, found {value!r}")
    return value
