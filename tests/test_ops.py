"""qscheme.modules.ops: QuantLinear's kernel call as registered torch custom ops with fake implementations."""

from __future__ import annotations

import copy
import gc
import os

import pytest
import torch
from checkpoint_cache import single_threaded_torch  # noqa: F401

from qscheme.errors import UsageError
from qscheme.modules import QuantLinear, layer_for
from qscheme.quantize import quantize_weight

SCHEME = "compressed-tensors/NVFP4A16"


def _layer(kernel: str | None = None, bias: bool = False) -> QuantLinear:
    weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
    tensors = quantize_weight(weight, SCHEME)
    return QuantLinear.from_tensors(
        SCHEME, tensors, kernel=kernel, bias=torch.randn(48) if bias else None, activation_dtype=torch.float32
    )


def test_the_ops_are_registered_with_fake_and_autograd_implementations_that_pass_opcheck() -> None:
    layer = _layer(bias=True)
    x = torch.randn(3, 5, 64, requires_grad=True)
    torch.library.opcheck(torch.ops.qscheme.quant_linear.default, (x, layer._op_handle, layer.out_features))
    grad_y = torch.randn(3, 5, 48)
    torch.library.opcheck(
        torch.ops.qscheme.quant_linear_input_grad.default, (grad_y, layer._op_handle, layer.in_features)
    )


def test_the_op_computes_what_the_layer_computes_and_its_gradient_goes_through_the_effective_weight() -> None:
    layer = _layer(bias=True)
    x = torch.randn(4, 64, requires_grad=True)
    y = torch.ops.qscheme.quant_linear(x, layer._op_handle, layer.out_features)
    with torch.no_grad():
        assert torch.equal(y, layer(x))
    y.sum().backward()
    expected = torch.ones(4, 48) @ layer.effective_weight()
    torch.testing.assert_close(x.grad, expected, rtol=1e-6, atol=1e-5)


def test_each_copy_of_a_layer_has_its_own_handle_and_a_freed_layer_is_a_usage_error() -> None:
    layer = _layer()
    copied = copy.deepcopy(layer)
    assert copied._op_handle != layer._op_handle
    assert layer_for(copied._op_handle) is copied
    handle = layer._op_handle
    del layer
    gc.collect()
    with pytest.raises(UsageError, match=f"layer handle {handle} names no live QuantLinear"):
        torch.ops.qscheme.quant_linear(torch.zeros(1, 64), handle, 48)


@pytest.mark.parametrize("kernel", ["reference", "triton"])
def test_a_compiled_unprepared_layer_is_one_graph_and_prepares_on_its_first_call(kernel: str) -> None:
    if kernel == "triton" and os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("the Triton kernel needs CUDA or TRITON_INTERPRET=1")
    x = torch.randn(2, 3, 64)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(_layer(kernel))(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    layer = _layer(kernel)
    assert not layer.prepared
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        y = compiled(x)
    assert layer.prepared
    with torch.no_grad():
        assert torch.equal(y, layer(x))
