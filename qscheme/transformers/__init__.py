"""transformers integration: ``from_pretrained`` loads quantized checkpoints through qscheme.

Importing this package registers, through transformers' public ``register_quantization_config``
/ ``register_quantizer``, the quantizers below. ``import qscheme`` arranges the same in either
import order without importing transformers: it registers at once when transformers' registry
(``transformers.quantizers.auto``) is loaded, else a one-shot import hook
(``qscheme._transformers_hook``) imports this package right after transformers loads it.

- ``modelopt``: NVIDIA ModelOpt exports, which transformers has no loader for;
- ``qscheme``: the self-describing checkpoints ``qscheme quantize`` writes for a scheme no
  producer writes (config.json embeds the descriptor, so no YAML file is needed to load them);
- ``qscheme-<quant_method>``: the opt-in route for every producer whose ``quant_method``
  transformers owns (``Producer.transformers_owns_method``: ``qscheme-compressed-tensors``,
  ``qscheme-fp8``, ...). The name itself stays transformers' own quantizer (which decompresses,
  or runs its library's modules); ``via_qscheme(path)`` gives a config that routes one
  checkpoint here.

``from_gguf(path)`` builds a model from a GGUF file (llama.cpp) with its quantized weights kept
quantized (see ``gguf``); ``from_pretrained(dir, gguf_file=name,
quantization_config=QSchemeGgufConfig())`` is the same route through transformers (see
``gguf_route``: making the config is the opt-in that adds qscheme's route to transformers' own
GGUF quantizer, which keeps its behaviour for every other config).

A name transformers (or anyone) already registered is left alone and reported by
``registered()``: qscheme never replaces a quantizer it did not register. See docs/transformers.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qscheme.errors import UsageError
from qscheme.transformers._config import (
    COMPRESSED_TENSORS_VIA_QSCHEME,
    CONFIGS,
    MODELOPT,
    QSCHEME,
    ROUTED_FROM,
    ROUTED_HIDDEN,
    ROUTES,
    SELECTING_KEYS,
    CompressedTensorsViaQSchemeConfig,
    ModeloptQuantizationConfig,
    QSchemeQuantizationConfig,
    routed_method,
)
from qscheme.transformers._quantizer import (
    ROUTED_QUANTIZERS,
    ModeloptHfQuantizer,
    QSchemeHfQuantizer,
    SelfDescribingHfQuantizer,
)
from qscheme.transformers.gguf import from_gguf
from qscheme.transformers.gguf_route import QSchemeGgufConfig

__all__ = [
    "COMPRESSED_TENSORS_VIA_QSCHEME",
    "MODELOPT",
    "QSCHEME",
    "ROUTES",
    "CompressedTensorsViaQSchemeConfig",
    "ModeloptQuantizationConfig",
    "QSchemeGgufConfig",
    "QSchemeHfQuantizer",
    "QSchemeQuantizationConfig",
    "from_gguf",
    "register",
    "registered",
    "routed_method",
    "via_qscheme",
]

_QUANTIZERS: dict[str, type[QSchemeHfQuantizer]] = {
    MODELOPT: ModeloptHfQuantizer,
    QSCHEME: SelfDescribingHfQuantizer,
    **ROUTED_QUANTIZERS,
}
_REGISTERED: dict[str, str] = {}  # method -> "qscheme" or why it was left to another quantizer


def register() -> dict[str, str]:
    """Register qscheme's quantizers with transformers (idempotent); returns ``registered()``."""
    from transformers.quantizers.auto import (
        AUTO_QUANTIZATION_CONFIG_MAPPING,
        AUTO_QUANTIZER_MAPPING,
        register_quantization_config,
        register_quantizer,
    )

    for method, quantizer in _QUANTIZERS.items():
        config = CONFIGS[method]
        have_config = AUTO_QUANTIZATION_CONFIG_MAPPING.get(method)
        have_quantizer = AUTO_QUANTIZER_MAPPING.get(method)
        if have_config is config and have_quantizer is quantizer:
            _REGISTERED[method] = "qscheme"
            continue
        if have_config is not None or have_quantizer is not None:
            owner = have_quantizer or have_config
            _REGISTERED[method] = f"left to {getattr(owner, '__module__', '?')}.{getattr(owner, '__name__', owner)}"
            continue
        register_quantization_config(method)(config)
        register_quantizer(method)(quantizer)
        _REGISTERED[method] = "qscheme"
    return registered()


def registered() -> dict[str, str]:
    """quant_method -> ``"qscheme"`` where qscheme's quantizer is registered, else who has the name."""
    return dict(_REGISTERED)


def via_qscheme(path: str | Path, *, kernel: str | None = None, **config_kwargs: Any) -> Any:
    """The checkpoint's transformers config (``AutoConfig.from_pretrained(path, **config_kwargs)``)
    with its ``quantization_config`` routed through qscheme when transformers owns its method
    (compressed-tensors, fp8, ...: ``ROUTES``, renamed ``qscheme-<quant_method>``): pass it as
    ``from_pretrained(path, config=via_qscheme(path))``. ``kernel`` (a kernel name, e.g.
    ``"triton"``) forces that kernel for every quantized layer instead of the resolver's choice.
    ModelOpt and qscheme checkpoints need no routing (their methods are qscheme's already), but
    take ``kernel`` the same way."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, **config_kwargs)
    quantization = getattr(config, "quantization_config", None)
    if quantization is not None and not isinstance(quantization, dict):
        quantization = quantization.to_dict()
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    owned = tuple(ROUTES.values())
    if method not in (*owned, *ROUTES, MODELOPT, QSCHEME):
        listed = ", ".join(repr(name) for name in owned)
        raise UsageError(
            f"via_qscheme({str(path)!r}): config.json's quantization_config has quant_method {method!r}; qscheme "
            f"routes {listed} checkpoints (and loads {MODELOPT!r} and {QSCHEME!r} ones without routing)"
        )
    assert isinstance(quantization, dict)
    routed = dict(quantization)
    if method in owned:
        routed.update({"quant_method": routed_method(method), ROUTED_FROM: method})
        hidden = {key: routed.pop(key) for key in SELECTING_KEYS if key in routed}
        if hidden:
            routed[ROUTED_HIDDEN] = hidden
    if kernel is not None:
        if not isinstance(kernel, str) or not kernel:
            raise UsageError(f"via_qscheme: kernel must be a kernel name such as 'triton', not {kernel!r}")
        routed["kernel"] = kernel
    config.quantization_config = routed
    return config


register()
