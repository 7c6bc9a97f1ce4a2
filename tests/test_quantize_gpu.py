"""quantize_weight and dequantize_weight on a CUDA device.

compressed-tensors divides by tensors on the weight's device, which CUDA does as true
divisions, so its rules give the CPU's tensors bit for bit. ModelOpt divides by Python numbers,
which torch does on CUDA through the reciprocal: its scales then differ from the CPU's in the last
bit, as ModelOpt's own export does on a GPU; those round trips are held to half a step instead.
Dequantization of the same tensors is bit-identical on both devices.
"""

from __future__ import annotations

import functools

import pytest
import torch
from quantize_bounds import assert_within_half_a_step, builtin_element_schemes

from qscheme.catalog import load_scheme
from qscheme.dequantize import dequantize_weight
from qscheme.descriptor import Scheme
from qscheme.quantize import quantize_weight

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BUILTIN = builtin_element_schemes()


@functools.cache
def _builtin(name: str) -> Scheme:
    return load_scheme(name)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.cpu().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("name", BUILTIN)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(256, 512), (130, 384)])
def test_quantize_and_dequantize_on_cuda(name: str, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    scheme = _builtin(name)
    n, k = shape
    if scheme.weight.packing == "int4_n" and n % 2:
        n += 1
    weight = (torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.05).to(dtype)
    weight[: n // 4, : k // 4] = 0.0
    on_cpu = quantize_weight(weight, scheme)
    on_gpu = quantize_weight(weight.cuda(), scheme)
    assert list(on_gpu) == list(on_cpu)
    for tensor_name, expected in on_cpu.items():
        got = on_gpu[tensor_name]
        assert got.device.type == "cuda", tensor_name
        assert got.dtype == expected.dtype and got.shape == expected.shape, tensor_name
        if scheme.rules == "compressed-tensors":
            assert torch.equal(_bytes(got), _bytes(expected)), tensor_name
    assert_within_half_a_step(scheme, weight, {tensor_name: value.cpu() for tensor_name, value in on_gpu.items()})
    restored = dequantize_weight({tensor_name: value.cuda() for tensor_name, value in on_cpu.items()}, scheme)
    assert restored.device.type == "cuda"
    assert torch.equal(restored.cpu().view(torch.int32), dequantize_weight(on_cpu, scheme).view(torch.int32))
