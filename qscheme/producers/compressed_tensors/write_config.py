"""config.json ``quantization_config`` as compressed-tensors 0.20 serialises it, for a scheme with
a ``detect.compressed-tensors`` rule: one ``config_group_0`` targeting ``Linear``, the rule's
arguments completed with the library's defaults, ``format``, ``ignore``,
``quantization_status: compressed``, ... Everything comes from the descriptor; there is no
per-scheme code."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from qscheme.descriptor import Scheme
from qscheme.producers.base import WriteRequest
from qscheme.producers.compressed_tensors.rule import rule_of

# The producer version whose serialisation is followed (what its own writer puts in the files).
COMPRESSED_TENSORS_VERSION = "0.20.1"
# compressed-tensors' QuantizationArgs defaults that its serialisation writes out.
_CT_ARGUMENT_DEFAULTS: dict[str, Any] = {"dynamic": False, "group_size": None, "symmetric": True}
_TORCH_SCALE_DTYPES = {"e4m3": "torch.float8_e4m3fn"}


def writes(scheme: Scheme) -> bool:
    """A scheme with a compressed-tensors detect rule is written as compressed-tensors."""
    return rule_of(scheme) is not None


def write_config(request: WriteRequest) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(config.json's ``quantization_config``, no other file); ``ignore`` is written as given."""
    return compressed_tensors_config(request.scheme, request.ignore), {}


def _ct_arguments(rule: Mapping[str, Any], scale_format: str | None) -> dict[str, Any]:
    arguments = {**_CT_ARGUMENT_DEFAULTS, **{key: _plain(value) for key, value in rule.items()}}
    if scale_format in _TORCH_SCALE_DTYPES:
        arguments.setdefault("scale_dtype", _TORCH_SCALE_DTYPES[scale_format])
    return dict(sorted(arguments.items()))


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    return value


def compressed_tensors_config(scheme: Scheme, ignore: Sequence[str]) -> dict[str, Any]:
    """config.json ``quantization_config`` as compressed-tensors 0.20 writes it for this scheme."""
    rule = rule_of(scheme)
    assert rule is not None
    fmt = rule.formats[0]
    activation = scheme.activation
    inputs = None
    if rule.input_activations is not None:
        inputs = _ct_arguments(rule.input_activations, activation.scale_format if activation else None)
        if inputs.get("dynamic") is False:
            inputs["observer"] = "static_minmax"  # what the library records for a calibrated static scale
    group = {
        "format": fmt,
        "input_activations": inputs,
        "output_activations": None,
        "targets": ["Linear"],
        "weights": _ct_arguments(rule.weights, scheme.weight.scale.format),
    }
    return {
        "config_groups": {"config_group_0": group},
        "format": fmt,
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": COMPRESSED_TENSORS_VERSION,
    }
