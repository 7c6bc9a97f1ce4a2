"""The transformers quantizers (``HfQuantizer``) that load checkpoints through qscheme.

One class per ``quant_method`` (transformers maps a method to a class). They share everything:
qscheme's loader reads the checkpoint's own config files and detects each module's scheme from
them (a self-describing ``qscheme`` checkpoint embeds its descriptor). Each loads pre-quantized
checkpoints only (qscheme does not quantize while loading: run ``qscheme quantize`` first) and
does its work before transformers loads weights (``plan_swap``: placeholders) and after
(``Swap.load``: the quantized layers); transformers loads the plain tensors in between.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers.quantizers.base import HfQuantizer

from qscheme.dtype_fallback import warn_dtype_fallbacks
from qscheme.errors import UsageError
from qscheme.text import shown
from qscheme.transformers._config import (
    COMPRESSED_TENSORS_VIA_QSCHEME,
    ROUTED_CONFIGS,
    QSchemeQuantizationConfig,
    RoutedQuantizationConfig,
)
from qscheme.transformers._finite import check_plain_finite
from qscheme.transformers._swap import Swap, plan_swap


def _device(device_map: object) -> torch.device:
    """The one device a device_map puts the model on (CPU when there is none)."""
    if device_map is None:
        return torch.device("cpu")
    values = set(device_map.values()) if isinstance(device_map, dict) else {device_map}
    if len(values) != 1:
        raise UsageError(
            f"qscheme loads a quantized model onto one device; device_map={device_map!r} spreads it over "
            f"{len(values)}: pass device_map='cpu', 'cuda' or 'cuda:N' (or none)"
        )
    value = values.pop()
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.device("cuda", value)
    if value in ("auto", "balanced", "sequential"):
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if value == "disk":
        raise UsageError("qscheme cannot offload quantized layers to disk; pass device_map='cpu' or 'cuda'")
    return torch.device(str(value))


class QSchemeHfQuantizer(HfQuantizer):
    """Loads a quantized checkpoint's layers as QuantLinear (and QuantExperts) modules."""

    requires_calibration = False
    quantization_config: QSchemeQuantizationConfig

    def __init__(self, quantization_config: QSchemeQuantizationConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self.swap: Swap | None = None
        self.folder: Path | None = None

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        if not self.pre_quantized:
            method = self.quantization_config.quant_method
            raise UsageError(
                f"quant_method {shown(method)!r}: qscheme loads checkpoints that are already quantized; it does not "
                "quantize while loading. Quantize first (`qscheme quantize`, compressed-tensors or ModelOpt), then "
                "load the quantized folder"
            )
        _device(kwargs.get("device_map"))

    def _process_model_before_weight_loading(self, model: Any, **kwargs: Any) -> Any:
        files = kwargs.get("checkpoint_files") or []
        if not files:
            raise UsageError(
                "qscheme loads quantized checkpoints from safetensors files; from_pretrained found none "
                "(pass a folder with model.safetensors or an index and its shards)"
            )
        folder = Path(files[0]).parent
        self.folder = folder
        dtype = kwargs.get("dtype") or getattr(model.config, "dtype", None) or torch.bfloat16
        self.swap = plan_swap(
            model,
            folder,
            device=_device(kwargs.get("device_map")),
            activation_dtype=dtype,
            kernel=self.quantization_config.kernel,
        )
        # qscheme read these keys itself; the QuantLinear buffers are not in the checkpoint
        model._keys_to_ignore_on_load_unexpected = {
            *(model._keys_to_ignore_on_load_unexpected or ()),
            *self.swap.taken_key_patterns(),
        }
        return model

    def _process_model_after_weight_loading(self, model: Any, **kwargs: Any) -> Any:
        if self.swap is not None:
            self.swap.load(model)
            check_plain_finite(model, self.folder)
            warn_dtype_fallbacks(model, "from_pretrained")
        return model

    def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
        return False  # save_pretrained would write canonical buffers, which no loader reads

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True


class ModeloptHfQuantizer(QSchemeHfQuantizer):
    """``quant_method: modelopt``: NVIDIA ModelOpt exports (``export_hf_checkpoint``)."""


class RoutedHfQuantizer(QSchemeHfQuantizer):
    """A checkpoint whose ``quant_method`` transformers owns, routed through qscheme
    (``via_qscheme``): registered as ``qscheme-<quant_method>``, one class per such producer."""


def _routed_quantizer(config: type[RoutedQuantizationConfig]) -> type[RoutedHfQuantizer]:
    return type(
        config.__name__.removesuffix("Config") + "HfQuantizer",
        (RoutedHfQuantizer,),
        {
            "__module__": __name__,
            "__doc__": f"A {config.routed_from} checkpoint routed through qscheme (``via_qscheme``).",
        },
    )


ROUTED_QUANTIZERS: dict[str, type[RoutedHfQuantizer]] = {
    method: _routed_quantizer(config) for method, config in ROUTED_CONFIGS.items()
}
CompressedTensorsViaQSchemeHfQuantizer = ROUTED_QUANTIZERS[COMPRESSED_TENSORS_VIA_QSCHEME]


class SelfDescribingHfQuantizer(QSchemeHfQuantizer):
    """``quant_method: qscheme``: the self-describing checkpoints ``qscheme quantize`` writes for a
    scheme no producer writes. config.json embeds the scheme's descriptor, and the loader
    (qscheme.checkpoint) builds the scheme from it: the YAML file need not be on any search path,
    and the scheme need not be in the catalog."""
