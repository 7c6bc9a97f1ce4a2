"""compressed-tensors' config: config.json ``quantization_config`` with ``quant_method:
compressed-tensors`` (written by compressed-tensors or llm-compressor), typed.

Both the 0.19 and 0.20 JSON forms are accepted; the argument objects are kept as written
(normalisation for matching is ``detect``'s job). ``re:`` targets and ignore entries are checked
for catastrophic backtracking and compiled once (``checkpoint.patterns``; kept in
``CompressedTensorsConfig.patterns`` for detection) and ``block_structure`` checked here, so that
a bad value fails with its key path instead of deep inside detection.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from qscheme.checkpoint.patterns import compile_entries
from qscheme.errors import CheckpointError
from qscheme.producers.base import ConfigFields


@dataclass(frozen=True)
class ConfigGroup:
    """One compressed-tensors ``config_groups`` entry."""

    name: str
    targets: tuple[str, ...]
    weights: Mapping[str, Any] | None
    input_activations: Mapping[str, Any] | None
    output_activations: Mapping[str, Any] | None
    format: str | None

    @property
    def key_path(self) -> str:
        return f"quantization_config.config_groups.{self.name}"


@dataclass(frozen=True)
class CompressedTensorsConfig:
    """config.json ``quantization_config`` written by compressed-tensors (or llm-compressor)."""

    file: str
    groups: tuple[ConfigGroup, ...]
    ignore: tuple[str, ...]
    format: str | None
    version: str | None
    quantization_status: str | None
    kv_cache_scheme: Mapping[str, Any] | None
    producer: str = "compressed-tensors"
    producer_version: str | None = None
    producer_note: str | None = None
    # Each re: entry of groups' targets and ignore, compiled once when read (detect.py compiles
    # any missing here, for configs built by hand).
    patterns: Mapping[str, re.Pattern[str]] = field(default_factory=dict, compare=False, repr=False)

    @property
    def has_kv_cache(self) -> bool:
        return bool(self.kv_cache_scheme)


def _argument_object(group: ConfigFields, key: str) -> Mapping[str, Any] | None:
    value = group.mapping(key)
    return dict(value) if value is not None else None


# compressed-tensors config sections that change what the tensors mean, which no scheme describes.
_UNSUPPORTED_SECTIONS = {
    "sparsity_config": "checkpoints with a sparsity config (2:4 bitmask or marlin-24 compressed weights) are not "
    "supported: their weights are not stored as the quantization formats describe; re-export with sparsity left "
    "dense (no sparse compression format)",
    "transform_config": "checkpoints with a transform config (rotations such as SpinQuant or QuIP applied to the "
    "weights) are not supported: the dequantized weights would need the inverse transform; re-export without "
    "transforms",
}


def read_section(fields: ConfigFields) -> CompressedTensorsConfig:
    groups_node = fields.child("config_groups")
    if groups_node is None or not groups_node.items:
        raise CheckpointError(f"{fields.file}: quantization_config.config_groups is missing or empty")
    groups = []
    patterns: dict[str, re.Pattern[str]] = {}
    for name in groups_node.items:
        group = groups_node.child(name)
        if group is None:
            raise CheckpointError(f"{fields.file}: quantization_config.config_groups.{name}: expected an object")
        targets = group.strings("targets")
        if not targets:
            raise CheckpointError(f"{fields.file}: {group.path}.targets: expected a non-empty list of strings")
        compile_entries(targets, patterns, fields.file, f"{group.path}.targets")
        arguments = {
            key: _argument_object(group, key) for key in ("weights", "input_activations", "output_activations")
        }
        for key, value in arguments.items():
            _check_block_structure(fields.file, f"{group.path}.{key}", value)
        groups.append(
            ConfigGroup(
                name=name,
                targets=targets,
                weights=arguments["weights"],
                input_activations=arguments["input_activations"],
                output_activations=arguments["output_activations"],
                format=group.string("format"),
            )
        )
    status = fields.string("quantization_status")
    if status is not None and status != "compressed":
        raise CheckpointError(
            f"{fields.file}: quantization_config.quantization_status is {status!r}; qscheme reads compressed "
            "checkpoints ('compressed'): save the model with compression (save_compressed=True)"
        )
    for unsupported, why in _UNSUPPORTED_SECTIONS.items():
        value = fields.mapping(unsupported)
        if value:
            raise CheckpointError(
                f"{fields.file}: quantization_config.{unsupported} is set ({json.dumps(value)[:80]}); {why}"
            )
    producer = fields.child("producer")
    ignore = fields.strings("ignore")
    compile_entries(ignore, patterns, fields.file, "quantization_config.ignore")
    return CompressedTensorsConfig(
        file=fields.file,
        groups=tuple(groups),
        ignore=ignore,
        format=fields.string("format"),
        version=fields.string("version"),
        quantization_status=status,
        kv_cache_scheme=fields.mapping("kv_cache_scheme"),
        producer=(producer.string("name") if producer else None) or "compressed-tensors",
        producer_version=(producer.string("version") if producer else None) or fields.string("version"),
        producer_note=producer.string("note") if producer else None,
        patterns=patterns,
    )


def block_sizes(value: object) -> list[int] | None:
    """A ``block_structure`` ("RxC", or [R, C]) as two ints; None when it is not written so."""
    parts = value.split("x") if isinstance(value, str) else value if isinstance(value, (list, tuple)) else None
    if parts is None or len(parts) != 2 or not all(_is_size(part) for part in parts):
        return None
    return [int(part) for part in parts]


def _is_size(part: object) -> bool:
    if isinstance(part, str):
        return part.isascii() and part.isdigit()
    return isinstance(part, int) and not isinstance(part, bool)


def _check_block_structure(file: str, where: str, arguments: Mapping[str, Any] | None) -> None:
    """``block_structure`` is absent, two positive sizes [rows, columns] or the string "RxC"."""
    value = arguments.get("block_structure") if arguments is not None else None
    if value is None:
        return
    sizes = block_sizes(value)
    if sizes is None or min(sizes) < 1:
        raise CheckpointError(
            f"{file}: {where}.block_structure: expected two positive sizes [rows, columns] such as [128, 128] "
            f'(or the string "128x128"), found {json.dumps(value)[:80]}'
        )
