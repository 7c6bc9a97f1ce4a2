"""The quantization configs qscheme registers with transformers, one per ``quant_method``.

transformers turns config.json's ``quantization_config`` into a config object through its
registry (``AutoQuantizationConfig``); these classes keep the producer's dictionary as it is
(``to_dict`` gives it back unchanged) because qscheme reads the checkpoint's own config files,
not this object, when it loads.

A producer whose ``quant_method`` transformers owns (``Producer.transformers_owns_method``:
compressed-tensors, fp8, ...) keeps its name for transformers' own quantizer; qscheme's route
for it is the opt-in ``qscheme-<quant_method>``, one config class per such producer, built from
``qscheme.producers.PRODUCERS`` (``ROUTES``), none written by hand.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from transformers.utils.quantization_config import QuantizationConfigMixin

from qscheme.producers import PRODUCERS

MODELOPT = "modelopt"
QSCHEME = "qscheme"
COMPRESSED_TENSORS = "compressed-tensors"
ROUTE_PREFIX = "qscheme-"  # the opt-in name of a method transformers owns: "qscheme-<quant_method>"
ROUTED_FROM = "qscheme_routed_from"  # key that records the method a routed config had
ROUTED_HIDDEN = "qscheme_routed_keys"  # keys of a routed config kept out of transformers' sight
SELECTING_KEYS: tuple[str, ...] = ("load_in_4bit", "load_in_8bit")
"""Keys from which transformers picks its own quantizer whatever the ``quant_method`` says
(``AutoQuantizationConfig.from_dict``): a routed config keeps them under ``ROUTED_HIDDEN``."""


def routed_method(quant_method: str) -> str:
    """The opt-in name under which qscheme loads checkpoints of a method transformers owns."""
    return f"{ROUTE_PREFIX}{quant_method}"


ROUTES: dict[str, str] = {
    routed_method(producer.quant_method): producer.quant_method
    for producer in PRODUCERS
    if producer.transformers_owns_method
}
"""Routed name -> the producer's own ``quant_method``, for every producer transformers owns."""

# The opt-in name: transformers' own quantizer keeps "compressed-tensors" (it decompresses).
COMPRESSED_TENSORS_VIA_QSCHEME = routed_method(COMPRESSED_TENSORS)


class QSchemeQuantizationConfig(QuantizationConfigMixin):
    """A checkpoint's ``quantization_config``, as its producer wrote it, for one of qscheme's
    quantizers. ``kernel`` (a kernel name) forces one kernel for every quantized layer."""

    method: str = QSCHEME

    def __init__(self, kernel: str | None = None, **fields: Any) -> None:
        fields.setdefault("quant_method", self.method)
        self.quant_method = fields["quant_method"]  # type: ignore[assignment]
        self.kernel = kernel
        self.fields = fields

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], return_unused_kwargs: bool = False, **kwargs: Any) -> Any:
        config = cls(**copy.deepcopy(dict(config_dict)))
        unused = {key: value for key, value in kwargs.items() if key != "kernel"}
        if "kernel" in kwargs:
            config.kernel = kwargs["kernel"]
        return (config, unused) if return_unused_kwargs else config

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.fields)

    def get_loading_attributes(self) -> dict[str, Any]:
        return {"kernel": self.kernel} if self.kernel is not None else {}


class ModeloptQuantizationConfig(QSchemeQuantizationConfig):
    """config.json ``quant_method: modelopt`` (NVIDIA ModelOpt's ``export_hf_checkpoint``)."""

    method = MODELOPT


class RoutedQuantizationConfig(QSchemeQuantizationConfig):
    """A ``quantization_config`` whose method transformers owns, routed through qscheme
    (``via_qscheme``); ``routed_from`` is the producer's own ``quant_method``."""

    routed_from: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The producer's dictionary, with its own ``quant_method`` back."""
        fields = copy.deepcopy(self.fields)
        fields["quant_method"] = fields.pop(ROUTED_FROM, self.routed_from)
        fields.update(fields.pop(ROUTED_HIDDEN, {}))
        return fields


def class_stem(quant_method: str) -> str:
    """``compressed-tensors`` -> ``CompressedTensors`` (the routed classes' names start with it)."""
    return "".join(part[:1].upper() + part[1:] for part in re.split(r"[^A-Za-z0-9]+", quant_method) if part)


def _routed_config(method: str, quant_method: str) -> type[RoutedQuantizationConfig]:
    return type(
        f"{class_stem(quant_method)}ViaQSchemeConfig",
        (RoutedQuantizationConfig,),
        {
            "method": method,
            "routed_from": quant_method,
            "__module__": __name__,
            "__doc__": f"A {quant_method} ``quantization_config`` routed through qscheme (``via_qscheme``).",
        },
    )


ROUTED_CONFIGS: dict[str, type[RoutedQuantizationConfig]] = {
    method: _routed_config(method, quant_method) for method, quant_method in ROUTES.items()
}
CompressedTensorsViaQSchemeConfig = ROUTED_CONFIGS[COMPRESSED_TENSORS_VIA_QSCHEME]

CONFIGS: dict[str, type[QSchemeQuantizationConfig]] = {
    MODELOPT: ModeloptQuantizationConfig,
    QSCHEME: QSchemeQuantizationConfig,
    **ROUTED_CONFIGS,
}
