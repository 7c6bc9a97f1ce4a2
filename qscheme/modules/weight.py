"""QuantizedWeight: what ``QuantLinear.weight`` gives: the weight's metadata, no values.

Model code reads ``module.weight.dtype`` / ``.device`` / ``.shape`` of its linears; a quantized
layer has no dense weight to give, so ``QuantLinear.weight`` is a tensor subclass on the meta
device that answers those questions for the layer and raises QuantizedWeightError, naming the
layer and what to do instead, for anything that needs the values or trains them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from qscheme.errors import UsageError
from qscheme.kernels.problem import normalize_dtype

if TYPE_CHECKING:
    from qscheme.modules.linear import QuantLinear

_TORCH_DTYPES = {normalize_dtype(dtype): dtype for dtype in (torch.bfloat16, torch.float16, torch.float32)}


class QuantizedWeightError(UsageError):
    """Something was asked of ``QuantLinear.weight`` that a quantized weight cannot do (compute
    with it, train it, write it)."""


class QuantizedWeight(Tensor):
    """``QuantLinear.weight``: metadata of the weight, no values (see ``QuantLinear.weight``).

    A tensor subclass on the meta device whose ``device`` reads as the layer's, so that code
    doing ``module.weight.dtype`` / ``.device`` / ``.shape`` keeps working, while any use of the
    values raises QuantizedWeightError naming the layer and what to do instead.
    """

    _layer_name: str
    _layer_device: torch.device

    @staticmethod
    def of(layer: QuantLinear) -> QuantizedWeight:
        dtype = _TORCH_DTYPES.get(layer.activation_dtype, torch.bfloat16)
        empty = torch.empty((layer.out_features, layer.in_features), dtype=dtype, device="meta")
        view = Tensor._make_subclass(QuantizedWeight, empty, False)
        view._layer_name = layer.layer_name or "QuantLinear"
        view._layer_device = layer.torch_device
        return view

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func == _DEVICE_GETTER and args and isinstance(args[0], QuantizedWeight):
            return args[0]._layer_device
        if func in _DEVICE_KIND and args and isinstance(args[0], QuantizedWeight):
            return args[0]._layer_device.type == _DEVICE_KIND[func]
        if func in _WEIGHT_METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        view = next((a for a in (*args, *(kwargs or {}).values()) if isinstance(a, QuantizedWeight)), None)
        layer = view._layer_name if view is not None else "a QuantLinear"
        what = _operation_name(func)
        if func in _TRAINING:
            raise QuantizedWeightError(
                f"{layer}: its weight is quantized and frozen ({what}): it cannot be trained. Train the "
                "unquantized model, or adapters beside the quantized layers (the input gets its gradient)"
            )
        raise QuantizedWeightError(
            f"{layer}: .weight of a quantized layer holds no values ({what} needs them); it tells only shape, "
            "dtype and device. Call the layer (layer(x)), or use layer.dequantize() / layer.effective_weight() "
            "for the float32 weight"
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        shape = list(self.shape)
        dtype = str(self.dtype).removeprefix("torch.")
        return f"QuantizedWeight({self._layer_name}, shape={shape}, dtype={dtype}, device={self._layer_device})"


def _operation_name(func: Callable[..., Any]) -> str:
    """``.requires_grad = ...`` for a property setter, ``.data`` for a getter, else the function's name."""
    name = getattr(func, "__name__", None) or repr(func)
    attribute = getattr(getattr(func, "__self__", None), "__name__", None)
    if name in ("__get__", "__set__") and attribute:
        return f".{attribute}" + (" = ..." if name == "__set__" else "")
    return name


_DEVICE_GETTER = Tensor.device.__get__  # type: ignore[attr-defined]
_DEVICE_KIND = {  # answered for the layer's device, as .device is
    Tensor.is_meta.__get__: "meta",  # type: ignore[attr-defined]
    Tensor.is_cuda.__get__: "cuda",  # type: ignore[attr-defined]
    Tensor.is_cpu.__get__: "cpu",  # type: ignore[attr-defined]
}
_WEIGHT_METADATA = {
    Tensor.shape.__get__,  # type: ignore[attr-defined]
    Tensor.dtype.__get__,  # type: ignore[attr-defined]
    Tensor.ndim.__get__,  # type: ignore[attr-defined]
    Tensor.requires_grad.__get__,  # type: ignore[attr-defined]
    Tensor.size,
    Tensor.dim,
    Tensor.numel,
    Tensor.element_size,
    Tensor.is_floating_point,
    Tensor.__len__,
}
_TRAINING = {  # is_leaf: the first thing an optimizer asks of its parameters
    Tensor.is_leaf.__get__,  # type: ignore[attr-defined]
    Tensor.requires_grad.__set__,  # type: ignore[attr-defined]
    Tensor.requires_grad_,
    Tensor.grad.__get__,  # type: ignore[attr-defined,union-attr]
    Tensor.grad.__set__,  # type: ignore[attr-defined,union-attr]
    Tensor.retains_grad.__get__,  # type: ignore[attr-defined]
}
