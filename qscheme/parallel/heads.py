"""Attention head counts from a checkpoint's config.json, and the degrees they allow.

``apply_to_model_tp`` gives every rank whole query heads and whole key/value heads: tp_size
must divide ``num_attention_heads`` and ``num_key_value_heads`` (key/value heads are not
replicated beyond their count, as vLLM does when there are fewer than ranks). ``qscheme
resolve --tp`` reads the same counts from config.json (or its ``text_config`` for a multimodal
model), so that the degrees it lists are the ones loading accepts. A config without head
counts constrains nothing; a count of the wrong type is a CheckpointError naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qscheme.checkpoint.config import CONFIG_FILE
from qscheme.errors import CheckpointError
from qscheme.parallel.rules import SplitProblem, working_degrees
from qscheme.storage import config_file_present, read_json

QUERY_KEY = "num_attention_heads"
KEY_VALUE_KEY = "num_key_value_heads"
NESTED_CONFIGS = ("text_config", "language_config", "llm_config")
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj")
SAMPLE_ATTENTION = "model.layers.0.self_attn"
"""A Llama attention module name, for a plan's style when the checkpoint quantizes no q/k/v."""


@dataclass(frozen=True)
class HeadCounts:
    """The model's query and key/value head counts, and the config key path they came from."""

    query: int
    key_value: int
    where: str  # "config.json" or "config.json text_config"

    def degrees(self) -> tuple[int, ...]:
        """The tensor-parallel degrees (up to 64) that give every rank whole query and key/value heads
        (the query count is a multiple of the key/value count, so those dividing the latter)."""
        return working_degrees(self.key_value, 1)

    def reason(self, tp_size: int) -> str | None:
        """Why ``tp_size`` ranks cannot share the heads whole; None when they can."""
        if self.query % tp_size == 0 and self.key_value % tp_size == 0:
            return None
        which = "key/value" if self.key_value % tp_size else "query"
        count = self.key_value if which == "key/value" else self.query
        return (
            f"{tp_size} ranks cannot share the model's heads whole ({self.where}: {self.query} query, "
            f"{self.key_value} key/value heads; {count} {which} heads do not divide by {tp_size}, and key/value "
            "heads are not replicated)"
        )

    def split_problem(self, layer: str, scheme: str, tp_size: int) -> SplitProblem | None:
        """The head constraint as a SplitProblem of a column-parallel q/k/v layer; None when it holds."""
        reason = self.reason(tp_size)
        if reason is None:
            return None
        return SplitProblem(layer, scheme, "column", "key/value heads", self.key_value, tp_size, reason, self.degrees())


def _count(section: Mapping[str, Any], key: str, where: str, path: Path) -> int | None:
    value = section.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(
            f"{path}: {where}{key} is {value!r}; a head count is a positive integer: fix config.json "
            "(the model's own config says how many heads it has)"
        )
    return value


def head_counts(folder: str | Path) -> HeadCounts | None:
    """The head counts in ``folder``/config.json; None when it has none (or no config.json).

    ``num_key_value_heads`` defaults to ``num_attention_heads`` (multi-head attention), as
    transformers does; the counts are looked for at the top level, then in a nested text config.
    """
    path = Path(folder) / CONFIG_FILE
    if not config_file_present(path):
        return None
    config = read_json(path)
    if not isinstance(config, Mapping):
        return None  # read_producer_config refuses it already, naming the file
    sections: list[tuple[str, Mapping[str, Any]]] = [("", config)]
    sections += [(f"{key}.", config[key]) for key in NESTED_CONFIGS if isinstance(config.get(key), Mapping)]
    for prefix, section in sections:
        query = _count(section, QUERY_KEY, prefix, path)
        if query is None:
            continue
        key_value = _count(section, KEY_VALUE_KEY, prefix, path) or query
        if query % key_value:
            raise CheckpointError(
                f"{path}: {prefix}{QUERY_KEY} = {query} is not a multiple of {prefix}{KEY_VALUE_KEY} = {key_value}; "
                "every key/value head serves the same number of query heads: fix config.json"
            )
        where = CONFIG_FILE + (f" {prefix.rstrip('.')}" if prefix else "")
        return HeadCounts(query, key_value, where)
    return None
