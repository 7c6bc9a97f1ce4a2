"""AWQ's config, typed: config.json's ``quantization_config`` with ``quant_method: awq``, as
AutoAWQ's ``to_transformers_dict`` writes it: ``zero_point``, ``group_size``, ``bits``,
``version`` (``gemm``, ``gemv``, ...: the packing; written lower case, read case-insensitively)
and ``modules_to_not_convert`` (AutoAWQ leaves unquantized every module whose name contains one
of them)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from qscheme.errors import CheckpointError
from qscheme.producers.base import ConfigFields
from qscheme.producers.gptq.keyed import boolean


@dataclass(frozen=True)
class AwqConfig:
    """AWQ's quantization section of config.json."""

    file: str
    bits: int
    group_size: int
    zero_point: bool
    version: str
    modules_to_not_convert: tuple[str, ...] = ()
    producer: str = "awq"
    producer_version: str | None = None
    producer_note: str | None = None

    @property
    def has_kv_cache(self) -> bool:
        return False

    def values(self) -> dict[str, Any]:
        return {"bits": self.bits, "group_size": self.group_size, "zero_point": self.zero_point}

    def not_converted_by(self, module: str) -> str | None:
        """The ``modules_to_not_convert`` entry ``module``'s name contains, or None."""
        return next((entry for entry in self.modules_to_not_convert if entry in module), None)


def read_section(fields: ConfigFields) -> AwqConfig:
    bits = fields.integer("bits")
    if bits is None:
        bits = fields.integer("w_bit")
    if bits is None or bits < 1 or bits > 8:
        raise CheckpointError(f"{fields.file}: {fields.path}.bits: expected 1 to 8 bits, found {json.dumps(bits)}")
    group_size = fields.integer("group_size")
    if group_size is None:
        group_size = fields.integer("q_group_size")
    if group_size is None or (group_size < 1 and group_size != -1):
        raise CheckpointError(
            f"{fields.file}: {fields.path}.group_size: expected a positive group size or -1, "
            f"found {json.dumps(group_size)}"
        )
    version = fields.string("version") or "gemm"
    return AwqConfig(
        file=fields.file,
        bits=bits,
        group_size=group_size,
        zero_point=boolean(fields.file, fields.path, fields.items, "zero_point", True),
        version=version.lower(),
        modules_to_not_convert=fields.strings("modules_to_not_convert"),
    )
