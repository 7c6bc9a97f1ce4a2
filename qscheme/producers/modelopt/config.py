"""NVIDIA ModelOpt's config, typed: hf_quant_config.json's ``quantization`` object, or config.json's
``quantization_config`` with ``quant_method: modelopt`` (a mixed-precision export names each
layer's algorithm in ``quantized_layers``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from qscheme.errors import CheckpointError
from qscheme.producers.base import ConfigFields

MODELOPT_FILE = "hf_quant_config.json"


@dataclass(frozen=True)
class MixedPrecisionLayer:
    quant_algo: str
    group_size: int | None


@dataclass(frozen=True)
class ModeloptConfig:
    """NVIDIA ModelOpt's quantization section (hf_quant_config.json or config.json)."""

    file: str
    quant_algo: str
    group_size: int | None
    exclude_modules: tuple[str, ...]
    kv_cache_quant_algo: str | None
    quantized_layers: Mapping[str, MixedPrecisionLayer] | None = None
    producer: str = "modelopt"
    producer_version: str | None = None
    producer_note: str | None = None

    @property
    def has_kv_cache(self) -> bool:
        return bool(self.kv_cache_quant_algo)

    @property
    def mixed_precision(self) -> bool:
        return self.quantized_layers is not None


def read_own_file(path: str, hf_quant: Mapping[str, Any]) -> ModeloptConfig:
    """hf_quant_config.json (its top-level JSON object): its ``quantization`` object and ``producer``."""
    section = ConfigFields(path, "", hf_quant).child("quantization")
    if section is None:
        raise CheckpointError(f"{path}: has no 'quantization' object; is it a ModelOpt export?")
    producer = ConfigFields(path, "", hf_quant).child("producer")
    return _modelopt(section, producer, exclude_key="exclude_modules")


def read_section(fields: ConfigFields) -> ModeloptConfig:
    """config.json's ``quantization_config`` with ``quant_method: modelopt``."""
    return _modelopt(fields, fields.child("producer"), exclude_key="ignore")


def _modelopt(section: ConfigFields, producer: ConfigFields | None, exclude_key: str) -> ModeloptConfig:
    quant_algo = section.string("quant_algo", required=True)
    assert quant_algo is not None  # required=True raised otherwise
    layers = None
    raw_layers = section.child("quantized_layers")
    if raw_layers is not None:
        layers = {}
        for module in raw_layers.items:
            entry = raw_layers.child(module)
            if entry is None:
                raise CheckpointError(f"{section.file}: {raw_layers.path}.{module}: expected an object")
            algo = entry.string("quant_algo", required=True)
            assert algo is not None
            layers[module] = MixedPrecisionLayer(quant_algo=algo, group_size=_group_size(entry))
    elif quant_algo.upper() == "MIXED_PRECISION":
        raise CheckpointError(
            f"{section.file}: {section.path + '.' if section.path else ''}quant_algo is MIXED_PRECISION "
            "but there is no quantized_layers object naming each layer's algorithm"
        )
    excludes = section.strings(exclude_key) or section.strings("exclude_modules")
    kv_cache = section.string("kv_cache_quant_algo")
    if kv_cache is None and section.mapping("kv_cache_scheme"):
        kv_cache = "kv_cache_scheme"
    return ModeloptConfig(
        file=section.file,
        quant_algo=quant_algo,
        group_size=_group_size(section) or _modelopt_group_size(section),
        exclude_modules=excludes,
        kv_cache_quant_algo=kv_cache,
        quantized_layers=layers,
        producer=(producer.string("name") if producer else None) or "modelopt",
        producer_version=producer.string("version") if producer else None,
    )


def _group_size(fields: ConfigFields) -> int | None:
    """A ModelOpt ``group_size``: absent, or the positive number of weights sharing one scale."""
    size = fields.integer("group_size")
    if size is not None and size < 1:
        where = f"{fields.path}.group_size" if fields.path else "group_size"
        raise CheckpointError(
            f"{fields.file}: {where}: expected a positive number of weights per scale (e.g. 16 for NVFP4), "
            f"found {size}; re-export the checkpoint or fix the value"
        )
    return size


def _modelopt_group_size(section: ConfigFields) -> int | None:
    """config.json's ModelOpt section may carry the group size only in its config_groups."""
    groups = section.mapping("config_groups") or {}
    sizes = set()
    for group in groups.values():
        weights = group.get("weights") if isinstance(group, Mapping) else None
        size = weights.get("group_size") if isinstance(weights, Mapping) else None
        if isinstance(size, int) and not isinstance(size, bool) and size >= 1:
            sizes.add(size)
    return sizes.pop() if len(sizes) == 1 else None
