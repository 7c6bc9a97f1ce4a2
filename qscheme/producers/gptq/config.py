"""GPTQ's config, typed: config.json's ``quantization_config`` with ``quant_method: gptq``, as
GPTQModel, AutoGPTQ, optimum and AutoRound's ``auto_gptq`` export write it.

``bits``, ``group_size`` (-1: one scale per output channel), ``sym``, ``desc_act``,
``checkpoint_format`` (``gptq``: the v1 format, stored zero points minus one; ``gptq_v2``: the zero
points themselves; absent means ``gptq``) and ``dynamic``: per-module overrides keyed by regular
expressions matched at the start of the module name, in order, the first match deciding
(``-:pattern`` leaves the module unquantized; ``+:pattern`` or a bare pattern overrides keys such
as ``bits`` and ``group_size``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from qscheme.checkpoint.patterns import compile_pattern
from qscheme.errors import CheckpointError
from qscheme.producers.base import ConfigFields
from qscheme.producers.gptq.keyed import boolean

BITS: tuple[int, ...] = (2, 3, 4, 8)
OVERRIDDEN: tuple[str, ...] = ("bits", "group_size", "sym", "desc_act")
"""The keys a ``dynamic`` override may change that decide a module's scheme."""


@dataclass(frozen=True)
class DynamicOverride:
    """One ``dynamic`` entry: its pattern as written, whether it skips the module, its values."""

    entry: str
    pattern: re.Pattern[str]
    skip: bool
    values: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GptqConfig:
    """GPTQ's quantization section of config.json."""

    file: str
    bits: int
    group_size: int
    sym: bool
    desc_act: bool
    checkpoint_format: str
    dynamic: tuple[DynamicOverride, ...] = ()
    producer: str = "gptq"
    producer_version: str | None = None
    producer_note: str | None = None

    @property
    def has_kv_cache(self) -> bool:
        return False

    def values(self) -> dict[str, Any]:
        """The values a scheme's rule is matched against."""
        return {"bits": self.bits, "group_size": self.group_size, "sym": self.sym}

    def module_values(self, module: str) -> tuple[dict[str, Any] | None, str]:
        """The values for ``module`` (None: ``dynamic`` leaves it unquantized) and where they come from."""
        for override in self.dynamic:
            if override.pattern.match(module):
                if override.skip:
                    return None, f"dynamic {override.entry!r}"
                merged = {**self.values(), **{k: v for k, v in override.values.items() if k in self.values()}}
                return merged, f"dynamic {override.entry!r}"
        return self.values(), f"{self.checkpoint_format} bits {self.bits}, group_size {self.group_size}"


def read_section(fields: ConfigFields) -> GptqConfig:
    items = fields.items
    bits = _bits(fields, fields.integer("bits"), "bits")
    group_size = _group_size(fields, fields.integer("group_size"), "group_size")
    sym = boolean(fields.file, fields.path, items, "sym", True)
    desc_act = boolean(fields.file, fields.path, items, "desc_act", False)
    checkpoint_format = fields.string("checkpoint_format") or "gptq"
    meta = fields.child("meta")
    quantizer = meta.strings("quantizer") if meta is not None else ()
    provider = fields.string("provider")
    return GptqConfig(
        file=fields.file,
        bits=bits,
        group_size=group_size,
        sym=sym,
        desc_act=desc_act,
        checkpoint_format=checkpoint_format,
        dynamic=_dynamic(fields),
        producer=provider or (quantizer[0].split(":")[0] if quantizer else "gptq"),
        producer_version=quantizer[0].partition(":")[2] or None if quantizer else None,
    )


def _bits(fields: ConfigFields, value: int | None, where: str) -> int:
    if value not in BITS:
        raise CheckpointError(
            f"{fields.file}: {fields.path}.{where}: expected one of {', '.join(map(str, BITS))} bits, "
            f"found {json.dumps(value)}"
        )
    return value


def _group_size(fields: ConfigFields, value: int | None, where: str) -> int:
    if value is None or (value < 1 and value != -1):
        raise CheckpointError(
            f"{fields.file}: {fields.path}.{where}: expected a positive group size or -1 (one scale per "
            f"output channel), found {json.dumps(value)}"
        )
    return value


def _dynamic(fields: ConfigFields) -> tuple[DynamicOverride, ...]:
    section = fields.child("dynamic")
    if section is None:
        return ()
    overrides = []
    for entry, values in section.items.items():
        where = f"{section.path}.{json.dumps(entry)}"
        skip = entry.startswith("-:")
        text = entry[2:] if entry.startswith(("-:", "+:")) else entry
        try:
            pattern = compile_pattern(text, f"{fields.file}: {where}")
        except re.error as error:
            raise CheckpointError(
                f"{fields.file}: {where}: not a regular expression ({error}); write +:REGEX or -:REGEX"
            ) from None
        if not isinstance(values, Mapping):
            raise CheckpointError(f"{fields.file}: {where}: expected an object of overrides, found {values!r}")
        child = ConfigFields(fields.file, where, values)
        checked: dict[str, Any] = {}
        if "bits" in values:
            checked["bits"] = _bits(child, child.integer("bits"), "bits")
        if "group_size" in values:
            checked["group_size"] = _group_size(child, child.integer("group_size"), "group_size")
        for key in ("sym", "desc_act"):
            if key in values:
                checked[key] = boolean(child.file, child.path, values, key, False)
        overrides.append(DynamicOverride(entry=entry, pattern=pattern, skip=skip, values=checked))
    return tuple(overrides)
