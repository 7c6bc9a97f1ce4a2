"""QuantLinear on a real CUDA GPU (skipped without one): a layer built on the CPU and moved with
``module.to("cuda")`` computes what one built on the GPU computes, with the GPU's kernel, its
canonical tensors left in host memory; input gradients on the GPU equal the CPU's."""

from __future__ import annotations

import pytest
import torch

import qscheme
from qscheme.modules import QuantLinear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
SCHEMES = [
    "compressed-tensors/NVFP4A16",
    "compressed-tensors/W4A16",
    "compressed-tensors/FP8_DYNAMIC",
    # issue 27's producers: GPTQ, AWQ, DeepSeek FP8 blocks, gpt-oss MXFP4
    "gptq/W4A16",
    "awq/W4A16_ASYM",
    "fp8/FP8_BLOCK",
    "mxfp4/MXFP4",
]


def _tensors(scheme: str) -> dict[str, torch.Tensor]:
    weight = torch.randn(256, 512, generator=torch.Generator().manual_seed(0)) * 0.05
    return qscheme.quantize_weight(weight.to(torch.bfloat16), scheme)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_layer_moved_to_the_gpu_runs_there_as_one_built_there(scheme: str) -> None:
    tensors = _tensors(scheme)
    bias = torch.randn(256)
    moved = QuantLinear.from_tensors(scheme, tensors, bias=bias).prepare()
    assert any(device.type == "cpu" for device in moved.kernel.devices)  # resolved for the CPU
    moved.to("cuda")
    assert moved.torch_device.type == "cuda" and not moved.prepared
    state = moved.state_dict()
    assert state["bias"].is_cuda  # the bias moves as an nn.Linear's does
    # the canonical tensors stay in host memory: the GPU holds only the kernel's prepared form
    assert all(value.device.type == "cpu" for name, value in state.items() if name.startswith("canonical_"))
    built = QuantLinear.from_tensors(scheme, tensors, device="cuda", bias=bias)
    assert moved.kernel.name == built.kernel.name  # re-resolved for the GPU
    assert any(device.type == "cuda" for device in moved.kernel.devices)
    x = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(moved(x), built(x))
    back = moved.to("cpu")
    assert back.torch_device == torch.device("cpu")
    torch.testing.assert_close(back(x.cpu()).float(), built(x).float().cpu(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_input_gradients_on_the_gpu_equal_the_cpus(scheme: str) -> None:
    tensors = _tensors(scheme)
    x = torch.randn(3, 512)
    grad_y = torch.randn(3, 256)
    grads = []
    for device in ("cpu", "cuda"):
        layer = QuantLinear.from_tensors(scheme, tensors, device=device)
        inputs = x.to(device).requires_grad_()
        layer(inputs).backward(grad_y.to(device))
        assert inputs.grad is not None
        grads.append(inputs.grad.cpu())
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-5)
