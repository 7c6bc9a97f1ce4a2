"""The quantization config a written checkpoint carries, as its producer writes it.

Everything comes from the scheme's descriptor (its ``detect`` block, formats and granularity),
the ignore list and the modules left unquantized; there is no per-scheme code:

- a scheme with a ``detect.compressed-tensors`` rule gets config.json ``quantization_config`` as
  compressed-tensors 0.20 serialises it (one ``config_group_0`` targeting ``Linear``, the rule's
  arguments completed with the library's defaults, ``format``, ``ignore``,
  ``quantization_status: compressed``, ...);
- a scheme with a ``detect.modelopt`` rule gets ModelOpt's ``hf_quant_config.json``
  (``quant_algo``, ``group_size``, ``exclude_modules``) and the ``quantization_config`` ModelOpt
  puts in config.json;
- any other scheme (one written only in YAML, that no producer writes) gets a self-describing
  config: ``{"quant_method": "qscheme", "scheme": NAME, "descriptor": <the YAML text>,
  "ignore": [...]}``. ``load_checkpoint`` and ``qscheme inspect`` parse the embedded descriptor,
  so the checkpoint loads where the YAML file is unknown.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from qscheme.descriptor import Scheme
from qscheme.formats import get_element_format

CONFIG_FILE = "config.json"
MODELOPT_FILE = "hf_quant_config.json"
QSCHEME_METHOD = "qscheme"
QSCHEME_CONFIG_VERSION = 1
# The producer versions whose serialisation is followed (what their own writers put in the files).
COMPRESSED_TENSORS_VERSION = "0.20.1"
MODELOPT_VERSION = "0.47.0"
# compressed-tensors' QuantizationArgs defaults that its serialisation writes out.
_CT_ARGUMENT_DEFAULTS: dict[str, Any] = {"dynamic": False, "group_size": None, "symmetric": True}
_TORCH_SCALE_DTYPES = {"e4m3": "torch.float8_e4m3fn"}


def producer_of(scheme: Scheme) -> str:
    """``compressed-tensors``, ``modelopt`` (the producer whose config recognises the scheme) or ``qscheme``."""
    if scheme.detect.compressed_tensors is not None:
        return "compressed-tensors"
    if scheme.detect.modelopt is not None:
        return "modelopt"
    return QSCHEME_METHOD


def config_files(
    scheme: Scheme,
    source_config: Mapping[str, Any],
    *,
    ignore: Sequence[str],
    unquantized_modules: Sequence[str],
    descriptor_text: str | None = None,
    note: str | None = None,
) -> dict[str, dict[str, Any]]:
    """{file name: JSON object} for the quantization configs of a checkpoint in ``scheme``.

    ``source_config`` is the source's config.json (copied with its ``quantization_config``
    replaced); ``ignore`` the user's ignore entries (written as given for compressed-tensors and
    qscheme configs); ``unquantized_modules`` the 2-D weights' modules left in 16 bits (ModelOpt's
    ``exclude_modules`` lists them by name). ``descriptor_text`` is required for a scheme no
    producer recognises.
    """
    producer = producer_of(scheme)
    config = {key: value for key, value in source_config.items() if key != "quantization_config"}
    files: dict[str, dict[str, Any]] = {}
    if producer == "compressed-tensors":
        config["quantization_config"] = compressed_tensors_config(scheme, ignore)
    elif producer == "modelopt":
        section = modelopt_section(scheme, unquantized_modules)
        producer_block = {"name": "modelopt", "version": MODELOPT_VERSION}
        if note:
            producer_block["note"] = note
        files[MODELOPT_FILE] = {"producer": producer_block, "quantization": section}
        config["quantization_config"] = modelopt_config(scheme, unquantized_modules, producer_block)
    else:
        if descriptor_text is None:
            raise ValueError("a self-describing config needs the descriptor text")
        config["quantization_config"] = self_describing_config(scheme, descriptor_text, ignore, note)
    files[CONFIG_FILE] = config
    return dict(sorted(files.items()))


# --- compressed-tensors -------------------------------------------------------------------------


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
    rule = scheme.detect.compressed_tensors
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


# --- ModelOpt -----------------------------------------------------------------------------------


def modelopt_section(scheme: Scheme, unquantized_modules: Sequence[str]) -> dict[str, Any]:
    """hf_quant_config.json's ``quantization`` object."""
    rule = scheme.detect.modelopt
    assert rule is not None
    section: dict[str, Any] = {"quant_algo": rule.quant_algos[0], "kv_cache_quant_algo": None}
    group_size = rule.group_size or scheme.weight.scale.group_size
    if group_size is not None and scheme.weight.scale.granularity == "group":
        section["group_size"] = group_size
    section["exclude_modules"] = list(unquantized_modules)
    return section


def _modelopt_arguments(element_format: str, group_size: int | None) -> dict[str, Any]:
    element = get_element_format(element_format)
    arguments: dict[str, Any] = {"dynamic": False, "num_bits": element.bits, "type": element.kind}
    if group_size is not None:
        arguments["group_size"] = group_size
    return arguments


def modelopt_config(scheme: Scheme, unquantized_modules: Sequence[str], producer: Mapping[str, str]) -> dict[str, Any]:
    """The ``quantization_config`` ModelOpt's exporter writes into config.json."""
    rule = scheme.detect.modelopt
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


# --- self-describing ----------------------------------------------------------------------------


def self_describing_config(
    scheme: Scheme, descriptor_text: str, ignore: Sequence[str], note: str | None = None
) -> dict[str, Any]:
    """``quant_method: qscheme``: the scheme's name and its whole descriptor, embedded."""
    from qscheme import __version__

    producer = {"name": "qscheme", "version": __version__}
    if note:
        producer["note"] = note
    return {
        "quant_method": QSCHEME_METHOD,
        "version": QSCHEME_CONFIG_VERSION,
        "scheme": scheme.name,
        "descriptor": descriptor_text,
        "ignore": list(ignore),
        "producer": producer,
    }
