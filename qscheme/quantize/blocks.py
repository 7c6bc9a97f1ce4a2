"""Quantizers of packed-block schemes (``packing: blocks``), by the rule set a scheme names.

A block scheme's producer quantizes a whole block at once (llama.cpp's reference searches), not
through scales and rounding as ``qscheme.quantize.rules`` describes them. Its arithmetic module
registers one function per rule set: float weight [N, K] -> the block bytes, uint8
[N, K / elements * bytes], for the scheme given. ``quantize_weight`` calls it for block schemes.
A producer that quantizes whole layers of another layout at once (bitsandbytes' codebooks with
their JSON state) registers a ``LayerQuantizer`` for its rule set instead.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from qscheme.descriptor import Scheme
from qscheme.errors import QuantizeError

BlockQuantizer = Callable[[Scheme, Tensor], Tensor]

_QUANTIZERS: dict[str, BlockQuantizer] = {}


def register_block_quantizer(rules: str, quantizer: BlockQuantizer) -> BlockQuantizer:
    """Make ``quantizer`` quantize the block schemes whose ``rules`` is ``rules``."""
    _QUANTIZERS[rules] = quantizer
    return quantizer


def quantize_blocks_for(scheme: Scheme, weight: Tensor) -> dict[str, Tensor]:
    """The scheme's one tensor (its raw blocks) for a float weight [N, K]."""
    quantizer = _QUANTIZERS.get(scheme.rules)
    if quantizer is None:
        known = ", ".join(sorted(_QUANTIZERS)) or "none"
        raise QuantizeError(
            f"scheme {scheme.name}: no block quantizer for rules {scheme.rules!r} (known: {known}); "
            "name a producer that quantizes blocks"
        )
    return {scheme.weight.tensor.name: quantizer(scheme, weight)}


LayerQuantizer = Callable[[Scheme, Tensor], dict[str, Tensor]]
"""A producer's quantizer of a whole layer: float weight [N, K] -> every tensor the scheme declares,
by checkpoint name (bitsandbytes: codes, absmax, tables and the JSON state from one pass)."""

_LAYER_QUANTIZERS: dict[str, LayerQuantizer] = {}


def register_layer_quantizer(rules: str, quantizer: LayerQuantizer) -> LayerQuantizer:
    """Make ``quantizer`` quantize every scheme whose ``rules`` is ``rules``, whole layers at once."""
    _LAYER_QUANTIZERS[rules] = quantizer
    return quantizer


def layer_quantizer(scheme: Scheme) -> LayerQuantizer | None:
    """The whole-layer quantizer of the scheme's rule set, or None (it quantizes through rules)."""
    return _LAYER_QUANTIZERS.get(scheme.rules)
