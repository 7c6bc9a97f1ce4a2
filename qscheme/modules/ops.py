"""QuantLinear's kernel call as torch custom ops, so that torch.compile sees one opaque call.

A kernel's state is a Python object (a dequantized weight, a repacked layout) that is built on
first use (``QuantLinear.prepare``), and its code may be anything: a Triton launch (interpreted
on CPU), a vendor library, plain torch. Dynamo cannot trace all of that in one graph, so under
``torch.compile`` ``QuantLinear.forward`` calls ``torch.ops.qscheme.quant_linear`` instead: an
operator registered with ``torch.library`` whose fake implementation gives the output's shape
and dtype (``[..., N]`` in the input's dtype) without running anything, and whose real
implementation runs the layer's eager kernel path (prepare on first use, route warnings, output
checks, typed errors). A compiled model therefore needs no manual ``prepare()``, and
``fullgraph=True`` holds whatever kernel runs the layer.

The layer travels through the graph as an integer handle (tensors and scalars are all an
operator may take); ``handle_for`` gives a layer its own, looked up in a table that holds the
layers weakly. Gradients flow to the input through ``quant_linear_input_grad`` (the effective
weight, straight through activation quantization), as in eager mode; the weight gets none.
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from qscheme.errors import UsageError

if TYPE_CHECKING:
    from qscheme.modules.linear import QuantLinear

_LAYERS: weakref.WeakValueDictionary[int, QuantLinear] = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def handle_for(layer: QuantLinear) -> int:
    """A new handle for ``layer``: the integer the custom ops find it by (each copy of a layer,
    deepcopy or unpickled, gets its own)."""
    handle = next(_HANDLES)
    _LAYERS[handle] = layer
    return handle


def layer_for(handle: int) -> QuantLinear:
    """The live layer behind ``handle``; UsageError when it has been freed."""
    layer = _LAYERS.get(handle)
    if layer is None:
        raise UsageError(
            f"qscheme::quant_linear: layer handle {handle} names no live QuantLinear (the layer was freed); "
            "recompile the model that holds the layer (torch._dynamo.reset()) rather than reusing a compiled "
            "graph of a deleted model"
        )
    return layer


_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _checked_call(
    op: str, layer: QuantLinear, value: Tensor, features: int, sizes: tuple[str, int, str, int]
) -> QuantLinear:
    """``layer`` once ``value`` and the size argument fit it; UsageError naming the operator, the
    layer and the bad value otherwise (a direct call of the operator with arguments no
    QuantLinear forward would pass)."""
    name = layer.layer_name or "QuantLinear"
    last, last_size, argument, expected = sizes
    if value.dtype not in _FLOAT_DTYPES:
        raise UsageError(
            f"qscheme::{op} for layer {name}: a {value.dtype} tensor; the operator takes bfloat16, float16 or float32"
        )
    if value.dim() == 0 or value.shape[-1] != last_size:
        raise UsageError(
            f"qscheme::{op} for layer {name}: a tensor of shape {list(value.shape)}; its last dim must be the "
            f"layer's {last} = {last_size}"
        )
    if features != expected:
        raise UsageError(f"qscheme::{op} for layer {name}: {argument}={features}, but the layer's is {expected}")
    wanted = layer.torch_device
    if value.device.type != wanted.type or value.device.type == "meta":
        raise UsageError(f"qscheme::{op} for layer {name}: a tensor on {value.device}, the layer is on {wanted}")
    return layer


@torch.library.custom_op("qscheme::quant_linear", mutates_args=())
def quant_linear(x: Tensor, handle: int, out_features: int) -> Tensor:
    """y = layer(x) for the QuantLinear behind ``handle``, run eagerly by its kernel (no gradient)."""
    layer = layer_for(handle)
    sizes = ("K", layer.in_features, "out_features", layer.out_features)
    return _checked_call("quant_linear", layer, x, out_features, sizes)._kernel_forward(x)


@quant_linear.register_fake
def _quant_linear_fake(x: Tensor, handle: int, out_features: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.custom_op("qscheme::quant_linear_input_grad", mutates_args=())
def quant_linear_input_grad(grad_y: Tensor, handle: int, in_features: int) -> Tensor:
    """grad_x = grad_y @ effective_weight for the layer behind ``handle``, in grad_y's dtype."""
    layer = layer_for(handle)
    sizes = ("N", layer.out_features, "in_features", layer.in_features)
    return _checked_call("quant_linear_input_grad", layer, grad_y, in_features, sizes)._input_grad(grad_y)


@quant_linear_input_grad.register_fake
def _quant_linear_input_grad_fake(grad_y: Tensor, handle: int, in_features: int) -> Tensor:
    return grad_y.new_empty((*grad_y.shape[:-1], in_features))


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    _, handle, _ = inputs
    ctx.handle = handle
    ctx.in_features = layer_for(handle).in_features


def _backward(ctx: Any, grad_y: Tensor) -> tuple[Tensor, None, None]:
    grad_x: Tensor = torch.ops.qscheme.quant_linear_input_grad(grad_y, ctx.handle, ctx.in_features)
    return grad_x, None, None


quant_linear.register_autograd(_backward, setup_context=_setup_context)
