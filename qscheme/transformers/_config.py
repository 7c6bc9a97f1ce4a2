"""The quantization configs qscheme registers with transformers, one per ``quant_method``.

transformers turns config.json's ``quantization_config`` into a config object through its
registry (``AutoQuantizationConfig``); these classes keep the producer's dictionary as it is
(``to_dict`` gives it back unchanged) because qscheme reads the checkpoint's own config files,
not this object, when it loads.
"""

from __future__ import annotations

import copy
from typing import Any

from transformers.utils.quantization_config import QuantizationConfigMixin

MODELOPT = "modelopt"
QSCHEME = "qscheme"
COMPRESSED_TENSORS = "compressed-tensors"
# The opt-in name: transformers' own quantizer keeps "compressed-tensors" (it decompresses).
COMPRESSED_TENSORS_VIA_QSCHEME = "qscheme-compressed-tensors"
ROUTED_FROM = "qscheme_routed_from"  # key that records the method a routed config had


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


class CompressedTensorsViaQSchemeConfig(QSchemeQuantizationConfig):
    """A compressed-tensors ``quantization_config`` routed through qscheme (``via_qscheme``)."""

    method = COMPRESSED_TENSORS_VIA_QSCHEME

    def to_dict(self) -> dict[str, Any]:
        """The producer's dictionary, with its own ``quant_method`` back."""
        fields = copy.deepcopy(self.fields)
        fields["quant_method"] = fields.pop(ROUTED_FROM, COMPRESSED_TENSORS)
        return fields


CONFIGS: dict[str, type[QSchemeQuantizationConfig]] = {
    MODELOPT: ModeloptQuantizationConfig,
    QSCHEME: QSchemeQuantizationConfig,
    COMPRESSED_TENSORS_VIA_QSCHEME: CompressedTensorsViaQSchemeConfig,
}
