"""The notice that a model's dtype sends quantized layers to the slow reference kernel.

A kernel may take only some activation dtypes (``tinygemm_cpu`` takes bfloat16 only); a model
loaded in another dtype then runs those layers on the ``reference`` kernel, which dequantizes
every weight at every call. ``from_pretrained`` and ``apply_to_model`` call
``warn_dtype_fallbacks`` once after loading: one ``KernelFallbackWarning`` (a UserWarning, so
``warnings.filterwarnings("ignore", category=KernelFallbackWarning)`` silences it) naming the
layers, grouped by name pattern and bounded in length, the model's dtype, and the kernel and
dtype that would run them instead. Nothing is said when the reference kernel runs a layer for
another reason (no other kernel takes the scheme on this device, or it was forced).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from qscheme.modules import QuantLinear

REFERENCE = "reference"
ACTIVATION_DTYPES = ("bfloat16", "float16", "float32")
GROUPS_SHOWN = 6
_INDEX = re.compile(r"\.\d+(?=\.|$)")


class KernelFallbackWarning(UserWarning):
    """Quantized layers run on the reference kernel because of the model's dtype."""


@dataclass(frozen=True)
class DtypeFallback:
    """Layers whose ``dtype`` inputs run on the reference kernel, while ``better_dtype`` inputs
    would run on ``better_kernel`` (``reason``: why that kernel refused ``dtype``)."""

    dtype: str
    better_kernel: str
    better_dtype: str
    reason: str
    layers: tuple[str, ...]


def _better(layer: QuantLinear) -> tuple[str, str, str] | None:
    """(kernel, dtype, reason) of the first other activation dtype that runs this reference
    layer on another kernel, or None when the dtype is not why it runs on the reference."""
    dtype = layer.activation_dtype
    for other in ACTIVATION_DTYPES:
        if other == dtype:
            continue
        kernel = layer.kernel_for(other).name
        if kernel != REFERENCE:
            try:
                reason = layer.resolution.candidate(kernel).reason
            except KeyError:
                reason = ""
            return kernel, other, reason
    return None


def dtype_fallbacks(layers: Iterable[tuple[str, QuantLinear]]) -> list[DtypeFallback]:
    """The layers that run on the reference kernel only because of their activation dtype,
    grouped by (dtype, the kernel another dtype would get)."""
    found: dict[tuple[str, str, str, str], list[str]] = {}
    for name, layer in layers:
        if layer.forced_kernel or layer.kernel.name != REFERENCE:
            continue
        better = _better(layer)
        if better is not None:
            found.setdefault((layer.activation_dtype, *better), []).append(layer.layer_name or name)
    return [
        DtypeFallback(dtype, kernel, other, reason, tuple(names))
        for (dtype, kernel, other, reason), names in found.items()
    ]


def grouped_names(names: Iterable[str], limit: int = GROUPS_SHOWN) -> str:
    """Layer names grouped by pattern (indices as ``*``), each with its count (a group of one: the
    name), at most ``limit`` groups: ``model.layers.*.mlp.down_proj (22), lm_head and 3 more
    groups``."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(_INDEX.sub(".*", name), []).append(name)
    shown = [
        f"{pattern} ({len(members)})" if len(members) > 1 else members[0]
        for pattern, members in list(groups.items())[:limit]
    ]
    rest = len(groups) - limit
    return ", ".join(shown) + (f" and {rest} more group{'s' if rest > 1 else ''}" if rest > 0 else "")


def fallback_message(caller: str, fallbacks: Iterable[DtypeFallback]) -> str:
    """One message for every group: the layers, the model's dtype, the kernel another dtype gets."""
    parts = []
    for fallback in fallbacks:
        count = len(fallback.layers)
        why = f" ({fallback.better_kernel}: {fallback.reason})" if fallback.reason else ""
        parts.append(
            f"{count} quantized layer{'s' if count > 1 else ''} run{'' if count > 1 else 's'} on the slow reference "
            f"kernel (it dequantizes every weight at every call) because the model's dtype is {fallback.dtype}; "
            f"{fallback.better_dtype} inputs would run on {fallback.better_kernel}{why}. Layers: "
            f"{grouped_names(fallback.layers)}. Load the model in {fallback.better_dtype} "
            f"(dtype=torch.{fallback.better_dtype}) to use {fallback.better_kernel}"
        )
    return f"{caller}: " + "; ".join(parts)


def warn_dtype_fallbacks(model: torch.nn.Module, caller: str) -> list[DtypeFallback]:
    """One KernelFallbackWarning for ``model``'s QuantLinear layers that run on the reference
    kernel because of the model's dtype (none when there are none); returns their groups."""
    layers = [(name, module) for name, module in model.named_modules() if isinstance(module, QuantLinear)]
    fallbacks = dtype_fallbacks(layers)
    if fallbacks:
        warnings.warn(fallback_message(caller, fallbacks), KernelFallbackWarning, stacklevel=3)
    return fallbacks
