"""Read a checkpoint's producer config (config.json, or a producer's own file) into typed values.

The producers (``qscheme.producers.PRODUCERS``) are asked in turn: a producer's own file
(ModelOpt's hf_quant_config.json) wins when present, and config.json's ``quantization_config``
must then not name another method; otherwise ``quant_method`` names the producer whose folder
reads the section (``CompressedTensorsConfig``, ``ModeloptConfig``, ``QschemeConfig``: a
self-describing checkpoint written by ``qscheme quantize`` in a scheme no producer writes). Without
either, the checkpoint is unquantized: ``NoQuantization``.
Malformed JSON and wrongly typed fields raise CheckpointError naming the file, the line and
column (for JSON syntax) or the key path (for types). A config file that exists but is not a
regular file (a folder, a broken link, a FIFO) is an error, never "absent"; duplicate keys are
refused (``qscheme.storage``'s JSON reading).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qscheme.errors import CheckpointError
from qscheme.producers import PRODUCERS
from qscheme.producers.base import CONFIG_FILE, ConfigFields, ProducerConfig
from qscheme.storage import config_file_present, read_json

__all__ = ["CONFIG_FILE", "CONFIG_FILES", "NoQuantization", "ProducerConfig", "read_producer_config"]

# Every file that holds a producer config: config.json, then the producers' own files.
CONFIG_FILES: tuple[str, ...] = (CONFIG_FILE, *(p.own_file for p in PRODUCERS if p.own_file is not None))


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


def _json_object(path: Path) -> Mapping[str, Any]:
    value = read_json(path)
    if not isinstance(value, Mapping):
        raise CheckpointError(f"{path}: expected a JSON object at the top level, found {type(value).__name__}")
    return value


def read_producer_config(folder: str | Path) -> ProducerConfig:
    """The quantization config of a checkpoint folder.

    A producer's own file (hf_quant_config.json, ModelOpt) wins when present; config.json's
    ``quantization_config`` must then not name another method. Without either, the checkpoint is
    unquantized.
    """
    folder = Path(folder)
    config_path = folder / CONFIG_FILE
    config = _json_object(config_path) if config_file_present(config_path) else None
    quant = None
    if config is not None:
        quant = ConfigFields(str(config_path), "", config).mapping("quantization_config")
    method = None
    if quant is not None:
        method = ConfigFields(str(config_path), "quantization_config", quant).string("quant_method", required=True)

    for producer in PRODUCERS:
        if producer.own_file is None or producer.read_own_file is None:
            continue
        own_path = folder / producer.own_file
        if not config_file_present(own_path):
            continue
        if method is not None and method != producer.quant_method:
            raise CheckpointError(
                f"{config_path}: quantization_config.quant_method is {method!r} but {own_path.name} "
                f"(a {producer.label} export) is also present; remove the file that does not describe these weights"
            )
        return producer.read_own_file(str(own_path), _json_object(own_path))

    own_files = " and no ".join(p.own_file for p in PRODUCERS if p.own_file is not None)
    if quant is None or method is None:
        if config is None:
            reason = f"there is no {CONFIG_FILE} and no {own_files}"
        elif "quantization_config" in config:
            reason = f"{config_path.name}'s quantization_config is null and there is no {own_files}"
        else:
            reason = f"{config_path.name} has no quantization_config and there is no {own_files}"
        return NoQuantization(str(config_path) if config is not None else None, reason=reason)
    fields = ConfigFields(str(config_path), "quantization_config", quant)
    for producer in PRODUCERS:
        if method == producer.quant_method:
            return producer.read_section(fields)
    raise CheckpointError(
        f"{config_path}: quantization_config.quant_method {method!r} is not supported; qscheme reads "
        f"{_methods()} checkpoints (convert others with llm-compressor or ModelOpt)"
    )


def _methods() -> str:
    """The methods read, as the error lists them ("'compressed-tensors', 'modelopt' and ...")."""
    named = [producer.listed_as for producer in PRODUCERS]
    return ", ".join(named[:-1]) + " and " + named[-1] if len(named) > 1 else named[0]
