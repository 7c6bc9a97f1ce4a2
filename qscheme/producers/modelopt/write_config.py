"""ModelOpt's config files for a scheme with a ``detect.modelopt`` rule: hf_quant_config.json
(``quant_algo``, ``group_size``, ``exclude_modules``) and the ``quantization_config`` ModelOpt's
exporter puts in config.json."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from qscheme.descriptor import Scheme
from qscheme.formats.table import FORMAT_FACTS
from qscheme.producers.base import WriteRequest
from qscheme.producers.modelopt.config import MODELOPT_FILE
from qscheme.producers.modelopt.rule import rule_of

# The producer version whose serialisation is followed (what its own writer puts in the files).
MODELOPT_VERSION = "0.47.0"


def writes(scheme: Scheme) -> bool:
    """A scheme with a ModelOpt detect rule (and no compressed-tensors one) is written as ModelOpt."""
    return rule_of(scheme) is not None


def write_config(request: WriteRequest) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(config.json's ``quantization_config``, {hf_quant_config.json: its object}); the 2-D weights'
    modules left in 16 bits are listed by name in ``exclude_modules``."""
    scheme, unquantized = request.scheme, request.unquantized_modules
    section = modelopt_section(scheme, unquantized)
    producer_block = {"name": "modelopt", "version": MODELOPT_VERSION}
    if request.note:
        producer_block["note"] = request.note
    files = {MODELOPT_FILE: {"producer": producer_block, "quantization": section}}
    return modelopt_config(scheme, unquantized, producer_block), files


def modelopt_section(scheme: Scheme, unquantized_modules: Sequence[str]) -> dict[str, Any]:
    """hf_quant_config.json's ``quantization`` object."""
    rule = rule_of(scheme)
    assert rule is not None
    section: dict[str, Any] = {"quant_algo": rule.quant_algos[0], "kv_cache_quant_algo": None}
    group_size = rule.group_size or scheme.weight.scale.group_size
    if group_size is not None and scheme.weight.scale.granularity == "group":
        section["group_size"] = group_size
    section["exclude_modules"] = list(unquantized_modules)
    return section


def _modelopt_arguments(element_format: str, group_size: int | None) -> dict[str, Any]:
    element = FORMAT_FACTS[element_format]  # the torch-free facts: bits and kind
    arguments: dict[str, Any] = {"dynamic": False, "num_bits": element.bits, "type": element.kind}
    if group_size is not None:
        arguments["group_size"] = group_size
    return arguments


def modelopt_config(scheme: Scheme, unquantized_modules: Sequence[str], producer: Mapping[str, str]) -> dict[str, Any]:
    """The ``quantization_config`` ModelOpt's exporter writes into config.json."""
    rule = rule_of(scheme)
    assert rule is not None
    weight = scheme.weight
    group: dict[str, Any] = {
        "weights": _modelopt_arguments(
            weight.format, weight.scale.group_size if weight.scale.granularity == "group" else None
        )
    }
    activation = scheme.activation
    if activation is not None:
        size = activation.group_size if activation.granularity == "group" else None
        group = {"input_activations": _modelopt_arguments(activation.format, size), **group}
    group["targets"] = ["Linear"]
    return {
        "config_groups": {"group_0": group},
        "ignore": list(unquantized_modules),
        "quant_algo": rule.quant_algos[0],
        "producer": dict(producer),
        "quant_method": "modelopt",
    }
