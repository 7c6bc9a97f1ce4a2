"""Read a checkpoint's producer config (config.json / hf_quant_config.json) into typed values.

Four outcomes: ``CompressedTensorsConfig`` (config.json ``quant_method: compressed-tensors``),
``ModeloptConfig`` (hf_quant_config.json, or config.json ``quant_method: modelopt``),
``QschemeConfig`` (config.json ``quant_method: qscheme``: a self-describing checkpoint written by
``qscheme quantize`` in a scheme no producer writes, with the descriptor embedded) or
``NoQuantization``. Both the 0.19 and 0.20 JSON forms of compressed-tensors are accepted; the
argument objects are kept as written (normalisation for matching is detect.py's job).
Malformed JSON and wrongly typed fields raise CheckpointError naming the file, the line and
column (for JSON syntax) or the key path (for types). A config file that exists but is not a
regular file (a folder, a broken link, a FIFO) is an error, never "absent"; duplicate keys are
refused; ``re:`` targets and ignore entries are checked for catastrophic backtracking and
compiled once (patterns.py; kept in ``CompressedTensorsConfig.patterns`` for detection) and
``block_structure`` checked here, so that a bad value fails with its key path instead of deep
inside detection.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qscheme.checkpoint.patterns import compile_entries
from qscheme.errors import CheckpointError
from qscheme.storage import config_file_present, read_json

CONFIG_FILE = "config.json"
MODELOPT_FILE = "hf_quant_config.json"


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


@dataclass(frozen=True)
class NoQuantization:
    """A checkpoint without a quantization config: every tensor is a plain tensor.

    ``reason`` says why there is none (for the error when the tensors look quantized anyway).
    """

    file: str | None
    reason: str = "the checkpoint has no quantization config"
    producer: str = "none"
    producer_version: str | None = None
    producer_note: str | None = None
    has_kv_cache: bool = False


@dataclass(frozen=True)
class QschemeConfig:
    """config.json ``quantization_config`` with ``quant_method: qscheme``: the scheme's name and its
    whole descriptor (YAML text), so that the checkpoint loads where the YAML file is unknown."""

    file: str
    scheme: str
    descriptor: str
    ignore: tuple[str, ...]
    producer: str = "qscheme"
    producer_version: str | None = None
    producer_note: str | None = None
    has_kv_cache: bool = False


ProducerConfig = CompressedTensorsConfig | ModeloptConfig | QschemeConfig | NoQuantization


@dataclass
class _Fields:
    """Typed access to one JSON object, failing with the file and key path."""

    file: str
    path: str
    items: Mapping[str, Any] = field(default_factory=dict)

    def _fail(self, key: str, expected: str, value: Any) -> CheckpointError:
        where = f"{self.path}.{key}" if self.path else key
        return CheckpointError(f"{self.file}: {where}: expected {expected}, found {json.dumps(value)}")

    def string(self, key: str, required: bool = False) -> str | None:
        value = self.items.get(key)
        if value is None:
            if required:
                raise self._fail(key, "a string", value)
            return None
        if not isinstance(value, str):
            raise self._fail(key, "a string", value)
        return value

    def integer(self, key: str) -> int | None:
        value = self.items.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._fail(key, "an integer", value)
        return value

    def strings(self, key: str) -> tuple[str, ...]:
        value = self.items.get(key)
        if value is None:
            return ()
        if isinstance(value, str):
            return (value,)
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise self._fail(key, "a list of strings", value)
        return tuple(value)

    def mapping(self, key: str) -> Mapping[str, Any] | None:
        value = self.items.get(key)
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise self._fail(key, "an object", value)
        return value

    def child(self, key: str) -> _Fields | None:
        value = self.mapping(key)
        if value is None:
            return None
        return _Fields(self.file, f"{self.path}.{key}" if self.path else key, value)


def _json_object(path: Path) -> Mapping[str, Any]:
    value = read_json(path)
    if not isinstance(value, Mapping):
        raise CheckpointError(f"{path}: expected a JSON object at the top level, found {type(value).__name__}")
    return value


def read_producer_config(folder: str | Path) -> ProducerConfig:
    """The quantization config of a checkpoint folder.

    hf_quant_config.json (ModelOpt) wins when present; config.json's ``quantization_config``
    must then not name another method. Without either, the checkpoint is unquantized.
    """
    folder = Path(folder)
    config_path = folder / CONFIG_FILE
    modelopt_path = folder / MODELOPT_FILE
    config = _json_object(config_path) if config_file_present(config_path) else None
    quant = None
    if config is not None:
        quant = _Fields(str(config_path), "", config).mapping("quantization_config")
    method = None
    if quant is not None:
        method = _Fields(str(config_path), "quantization_config", quant).string("quant_method", required=True)

    if config_file_present(modelopt_path):
        if method is not None and method != "modelopt":
            raise CheckpointError(
                f"{config_path}: quantization_config.quant_method is {method!r} but {modelopt_path.name} "
                f"(a ModelOpt export) is also present; remove the file that does not describe these weights"
            )
        hf_quant = _json_object(modelopt_path)
        section = _Fields(str(modelopt_path), "", hf_quant).child("quantization")
        if section is None:
            raise CheckpointError(f"{modelopt_path}: has no 'quantization' object; is it a ModelOpt export?")
        producer = _Fields(str(modelopt_path), "", hf_quant).child("producer")
        return _modelopt(section, producer, exclude_key="exclude_modules")

    if quant is None or method is None:
        if config is None:
            reason = f"there is no {CONFIG_FILE} and no {MODELOPT_FILE}"
        elif "quantization_config" in config:
            reason = f"{config_path.name}'s quantization_config is null and there is no {MODELOPT_FILE}"
        else:
            reason = f"{config_path.name} has no quantization_config and there is no {MODELOPT_FILE}"
        return NoQuantization(str(config_path) if config is not None else None, reason=reason)
    fields = _Fields(str(config_path), "quantization_config", quant)
    if method == "compressed-tensors":
        return _compressed_tensors(fields)
    if method == "modelopt":
        return _modelopt(fields, fields.child("producer"), exclude_key="ignore")
    if method == "qscheme":
        return _qscheme(fields)
    raise CheckpointError(
        f"{config_path}: quantization_config.quant_method {method!r} is not supported; qscheme reads "
        "'compressed-tensors', 'modelopt' and its own self-describing 'qscheme' checkpoints (convert others with "
        "llm-compressor or ModelOpt)"
    )


def _check_embedded_size(file: str, descriptor: str) -> None:
    """An embedded descriptor is at most MAX_EMBEDDED_DESCRIPTOR_BYTES of UTF-8 (the built-in
    descriptors are 1-3 KB): a larger one is refused before it is parsed."""
    from qscheme.descriptor.files import MAX_EMBEDDED_DESCRIPTOR_BYTES

    size = len(descriptor.encode("utf-8", "surrogatepass"))
    if size > MAX_EMBEDDED_DESCRIPTOR_BYTES:
        raise CheckpointError(
            f"{file}: quantization_config.descriptor is {size:,} bytes; an embedded scheme descriptor is at most "
            f"{MAX_EMBEDDED_DESCRIPTOR_BYTES:,} bytes (256 KiB; real ones are a few KB): this is not a config "
            "qscheme quantize wrote; re-write the checkpoint with `qscheme quantize`, or re-download it"
        )


def _qscheme(fields: _Fields) -> QschemeConfig:
    """A self-describing config: ``scheme`` and ``descriptor`` (the YAML text) are required."""
    scheme = fields.string("scheme", required=True)
    descriptor = fields.string("descriptor", required=True)
    assert scheme is not None and descriptor is not None  # required=True raised otherwise
    _check_embedded_size(fields.file, descriptor)
    producer = fields.child("producer")
    return QschemeConfig(
        file=fields.file,
        scheme=scheme,
        descriptor=descriptor,
        ignore=fields.strings("ignore"),
        producer=(producer.string("name") if producer else None) or "qscheme",
        producer_version=producer.string("version") if producer else None,
        producer_note=producer.string("note") if producer else None,
    )


def _argument_object(group: _Fields, key: str) -> Mapping[str, Any] | None:
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


def _compressed_tensors(fields: _Fields) -> CompressedTensorsConfig:
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


def _modelopt(section: _Fields, producer: _Fields | None, exclude_key: str) -> ModeloptConfig:
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


def _group_size(fields: _Fields) -> int | None:
    """A ModelOpt ``group_size``: absent, or the positive number of weights sharing one scale."""
    size = fields.integer("group_size")
    if size is not None and size < 1:
        where = f"{fields.path}.group_size" if fields.path else "group_size"
        raise CheckpointError(
            f"{fields.file}: {where}: expected a positive number of weights per scale (e.g. 16 for NVFP4), "
            f"found {size}; re-export the checkpoint or fix the value"
        )
    return size


def _modelopt_group_size(section: _Fields) -> int | None:
    """config.json's ModelOpt section may carry the group size only in its config_groups."""
    groups = section.mapping("config_groups") or {}
    sizes = set()
    for group in groups.values():
        weights = group.get("weights") if isinstance(group, Mapping) else None
        size = weights.get("group_size") if isinstance(weights, Mapping) else None
        if isinstance(size, int) and not isinstance(size, bool) and size >= 1:
            sizes.add(size)
    return sizes.pop() if len(sizes) == 1 else None
