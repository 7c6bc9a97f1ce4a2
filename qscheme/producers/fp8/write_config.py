"""The ``quantization_config`` of an ``fp8`` checkpoint, for a scheme with a ``detect.fp8`` rule:
the keys DeepSeek-V3 ships (``activation_scheme``, ``fmt``, ``quant_method``,
``weight_block_size``), ``scale_fmt`` when it is not ``float``, and the modules left in 16 bits in
``modules_to_not_convert`` (transformers' ``FineGrainedFP8Config`` reads them)."""

from __future__ import annotations

from typing import Any

from qscheme.descriptor import Scheme
from qscheme.producers.base import WriteRequest
from qscheme.producers.fp8.rule import rule_of


def writes(scheme: Scheme) -> bool:
    """A scheme with an fp8 detect rule is written as an fp8 checkpoint."""
    return rule_of(scheme) is not None


def write_config(request: WriteRequest) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(config.json's ``quantization_config``, no other file)."""
    scheme = request.scheme
    rule = rule_of(scheme)
    block = scheme.weight.scale.block
    if rule is None or block is None:
        raise ValueError(f"scheme {scheme.name} is not an fp8 block scheme (no detect.fp8 rule or no weight blocks)")
    section: dict[str, Any] = {
        "activation_scheme": rule.activation_schemes[0],
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(block),
    }
    if rule.scale_fmts[0] != "float":
        section["scale_fmt"] = rule.scale_fmts[0]
    if request.unquantized_modules:
        section["modules_to_not_convert"] = list(request.unquantized_modules)
    return section, {}
