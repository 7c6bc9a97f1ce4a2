"""The ``detect.gguf`` rule of a scheme descriptor: the GGUF tensor types (ggml type names, such
as ``Q4_K``) a scheme reads, as data for the descriptor's parser."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from qscheme.descriptor import Scheme
from qscheme.descriptor.rules import RuleKey, RuleSchema

NAME = "gguf"


@dataclass(frozen=True)
class GGUFRule:
    """Matches GGUF tensors of these ggml types (names as llama.cpp spells them, case-insensitive).

    ``file_type``: llama.cpp's ``general.file_type`` (its ``llama_ftype``) for a file whose
    weights are all of this scheme's type, which ``qscheme quantize`` writes (None: not written).
    """

    types: tuple[str, ...]
    file_type: int | None = None


def rule_of(scheme: Scheme) -> GGUFRule | None:
    """The scheme's ``detect.gguf`` rule, or None."""
    rule = scheme.detect.get(NAME)
    return rule if isinstance(rule, GGUFRule) else None


def _build(values: Mapping[str, Any]) -> GGUFRule:
    return GGUFRule(types=tuple(value.upper() for value in values["type"]), file_type=values["file_type"])


def _summary(rule: GGUFRule) -> dict[str, Any]:
    return {"type": list(rule.types), "file_type": rule.file_type}


def _render(rule: GGUFRule) -> str:
    return f"gguf tensor type {'|'.join(rule.types)}"


RULE_SCHEMA = RuleSchema(
    producer=NAME,
    keys=(RuleKey("type", "strings", required=True), RuleKey("file_type", "integer")),
    build=_build,
    summary=_summary,
    render=_render,
)
