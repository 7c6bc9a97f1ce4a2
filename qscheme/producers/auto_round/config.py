"""AutoRound's own config, typed: config.json's ``quantization_config`` with ``quant_method:
auto-round``, as AutoRound's exporter (``save_quantized_as_autoround``) writes it.

- ``bits``, ``group_size`` (-1: one scale per output channel), ``sym``, ``data_type`` (``int``: the
  only integer type; others are float formats qscheme refuses here), ``act_bits`` (16: weight-only;
  fewer bits quantize activations too, refused);
- ``packing_format`` (older exports: ``backend``; absent: ``auto_round:auto_gptq``, AutoRound's
  default): the layout, see ``packing``;
- ``block_name_to_quantize`` (older: ``to_quant_block_names``): the blocks whose linear layers are
  quantized, a comma-separated string or a list (a list of lists stands for each list's common
  prefix); absent: every module storing quantized tensors;
- ``extra_config``: per-layer overrides of ``bits``, ``group_size``, ``sym``, ``data_type`` and
  ``act_bits``, keyed by a full layer name or else by a regular expression searched in the name
  (the first that matches decides, as AutoRound's loader does); ``bits`` of 16 or more leaves the
  layer in floating point. Layers outside the blocks are quantized only when named here (lm_head).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from qscheme.errors import CheckpointError
from qscheme.producers.auto_round.packing import Layout, known, layout_of
from qscheme.producers.base import ConfigFields
from qscheme.producers.gptq.keyed import boolean

BITS: tuple[int, ...] = (2, 3, 4, 8)
DATA_TYPES: tuple[str, ...] = ("int",)
OVERRIDDEN: tuple[str, ...] = ("bits", "group_size", "sym", "data_type", "act_bits")
FLOAT_BITS = 16
"""``bits`` from here up leave a layer in floating point (AutoRound writes 16)."""


@dataclass(frozen=True)
class LayerOverride:
    """One ``extra_config`` entry: its key as written (a layer name or a regular expression), the
    key compiled, and the values it overrides."""

    entry: str
    pattern: re.Pattern[str]
    values: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AutoRoundConfig:
    """AutoRound's quantization section of config.json."""

    file: str
    bits: int
    group_size: int
    sym: bool
    data_type: str
    act_bits: int
    packing_format: str
    layout: Layout
    blocks: tuple[str, ...]
    extra: tuple[LayerOverride, ...] = ()
    producer: str = "auto-round"
    producer_version: str | None = None
    producer_note: str | None = None

    @property
    def has_kv_cache(self) -> bool:
        return False

    def defaults(self) -> dict[str, Any]:
        return {
            "bits": self.bits,
            "group_size": self.group_size,
            "sym": self.sym,
            "data_type": self.data_type,
            "act_bits": self.act_bits,
        }

    def override_of(self, module: str, layers: frozenset[str] = frozenset()) -> LayerOverride | None:
        """The ``extra_config`` entry for ``module``, as AutoRound's loader picks it: the key that is its
        name, else the first key that is no layer of the checkpoint (``layers``) and, as a regular
        expression, is found in the name (an entry with no values claims no layer)."""
        for override in self.extra:
            if override.entry == module:
                return override
        for override in self.extra:
            if override.entry not in layers and override.values and override.pattern.search(module):
                return override
        return None

    def in_blocks(self, module: str) -> bool:
        return not self.blocks or any(module.startswith(block) for block in self.blocks)

    def module_values(self, module: str, layers: frozenset[str] = frozenset()) -> tuple[dict[str, Any] | None, str]:
        """The values of ``module`` (None: left in floating point) and where they come from."""
        override = self.override_of(module, layers)
        if override is None and not self.in_blocks(module):
            return None, f"outside block_name_to_quantize {list(self.blocks)!r}"
        values = {**self.defaults(), **(override.values if override is not None else {})}
        origin = (
            f"extra_config {override.entry!r}"
            if override is not None
            else f"{self.packing_format} bits {self.bits}, group_size {self.group_size}"
        )
        if values["bits"] >= FLOAT_BITS:
            return None, origin
        return values, origin


def read_section(fields: ConfigFields) -> AutoRoundConfig:
    items = fields.items
    where = fields.path
    packing_format = fields.string("packing_format") or fields.string("backend") or "auto_round:auto_gptq"
    layout = layout_of(packing_format)
    if layout is None:
        raise CheckpointError(
            f"{fields.file}: {where}.packing_format: {packing_format!r} is not a layout qscheme reads; it reads "
            f"the integer layouts {known()}. Re-export with AutoRound's format 'auto_round' (or 'auto_gptq' / "
            "'auto_awq'); its other formats (fp8, nvfp4, mxfp4, llm_compressor) write compressed-tensors "
            "checkpoints when exported with format 'llm_compressor'"
        )
    version = fields.string("autoround_version")
    config = AutoRoundConfig(
        file=fields.file,
        bits=_bits(fields, "bits", fields.integer("bits")),
        group_size=_group_size(fields, "group_size", fields.integer("group_size")),
        sym=boolean(fields.file, where, items, "sym", True),
        data_type=_data_type(fields, "data_type", fields.string("data_type") or "int"),
        act_bits=_act_bits(fields, "act_bits", fields.integer("act_bits")),
        packing_format=packing_format,
        layout=layout,
        blocks=_blocks(fields),
        extra=_extra(fields),
        producer_version=version,
    )
    return config


def _bits(fields: ConfigFields, key: str, value: int | None) -> int:
    if value is None or (value not in BITS and value < FLOAT_BITS):
        raise CheckpointError(
            f"{fields.file}: {fields.path}.{key}: expected {', '.join(map(str, BITS))} bits (or 16 for a layer "
            f"left in floating point), found {json.dumps(value)}"
        )
    return value


def _group_size(fields: ConfigFields, key: str, value: int | None) -> int:
    if value is None or (value < 1 and value != -1):
        raise CheckpointError(
            f"{fields.file}: {fields.path}.{key}: expected a positive group size or -1 (one scale per output "
            f"channel), found {json.dumps(value)}"
        )
    return value


def _data_type(fields: ConfigFields, key: str, value: str) -> str:
    if value not in DATA_TYPES:
        raise CheckpointError(
            f"{fields.file}: {fields.path}.{key}: {value!r} weights are not stored in the integer layouts; "
            f"qscheme reads data_type {', '.join(repr(t) for t in DATA_TYPES)} from an AutoRound config. "
            "Export float formats with AutoRound's format 'llm_compressor' (a compressed-tensors checkpoint)"
        )
    return value


def _act_bits(fields: ConfigFields, key: str, value: int | None) -> int:
    if value is None:
        return FLOAT_BITS
    if value < FLOAT_BITS:
        raise CheckpointError(
            f"{fields.file}: {fields.path}.{key}: {value} quantizes activations too; qscheme reads AutoRound's "
            "weight-only checkpoints (act_bits 16). Export with format 'llm_compressor' for quantized activations"
        )
    return value


def _blocks(fields: ConfigFields) -> tuple[str, ...]:
    key = "block_name_to_quantize" if "block_name_to_quantize" in fields.items else "to_quant_block_names"
    value = fields.items.get(key)
    if value is None:
        return ()
    if isinstance(value, str):
        return tuple(name.strip() for name in value.split(",") if name.strip())
    if isinstance(value, list):
        blocks = []
        for item in value:
            if isinstance(item, str):
                blocks.append(item)
            elif isinstance(item, list) and item and all(isinstance(name, str) for name in item):
                blocks.append(_common_prefix(item).rstrip("."))
            else:
                break
        else:
            return tuple(blocks)
    raise CheckpointError(
        f"{fields.file}: {fields.path}.{key}: expected a comma-separated string or a list of block names "
        f"(or of lists of them), found {json.dumps(value)}"
    )


def _common_prefix(names: list[str]) -> str:
    """The characters every name starts with (AutoRound names a list of blocks by it)."""
    first, last = min(names), max(names)
    size = 0
    while size < len(first) and first[size] == last[size]:
        size += 1
    return first[:size]


def _extra(fields: ConfigFields) -> tuple[LayerOverride, ...]:
    section = fields.child("extra_config")
    if section is None:
        return ()
    overrides = []
    for entry, values in section.items.items():
        where = f"{section.path}.{json.dumps(entry)}"
        if not isinstance(values, Mapping):
            raise CheckpointError(f"{fields.file}: {where}: expected an object of overrides, found {values!r}")
        child = ConfigFields(fields.file, where, values)
        checked: dict[str, Any] = {}
        if values.get("bits") is not None:
            checked["bits"] = _bits(child, "bits", child.integer("bits"))
        quantized = checked.get("bits", fields.items.get("bits", 0)) < FLOAT_BITS
        if values.get("group_size") is not None and quantized:
            checked["group_size"] = _group_size(child, "group_size", child.integer("group_size"))
        if values.get("sym") is not None:
            checked["sym"] = boolean(child.file, child.path, values, "sym", True)
        if values.get("data_type") is not None and quantized:
            checked["data_type"] = _data_type(child, "data_type", child.string("data_type") or "int")
        if values.get("act_bits") is not None and quantized:
            checked["act_bits"] = _act_bits(child, "act_bits", child.integer("act_bits"))
        overrides.append(LayerOverride(entry=entry, pattern=_pattern(fields.file, where, entry), values=checked))
    return tuple(overrides)


def _pattern(file: str, where: str, entry: str) -> re.Pattern[str]:
    try:
        return re.compile(entry)
    except re.error as error:
        raise CheckpointError(
            f"{file}: {where}: neither a layer name nor a regular expression ({error}); key extra_config by "
            "the full layer name or a valid regular expression"
        ) from None
