"""QuantLinear: construction from checkpoint or canonical tensors, kernel choice, forward, errors."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch
from kernel_fakes import builtin_scheme, isolated_plugins, layer_tensors

import qscheme
from qscheme.canonical import canonicalize, dequantize
from qscheme.checkpoint.fuse import concatenate
from qscheme.dequantize import dequantize_weight
from qscheme.errors import NoKernelError, QuantizeError, UsageError
from qscheme.kernels.declaration import ANY_DEVICE, DeviceSupport, KernelDeclaration, Supports
from qscheme.linear import QuantLinear, problem_for
from qscheme.plugins import hookimpl, register_plugin


@pytest.fixture(autouse=True)
def builtin_kernels_without_triton(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Built-in plugins only; Triton (interpreted on CPU, slow) is disabled unless a test forces it."""
    monkeypatch.setenv("QSCHEME_DISABLED_KERNELS", "triton")
    monkeypatch.delenv("QSCHEME_KERNEL", raising=False)
    with isolated_plugins():
        yield


def test_exported_from_the_package() -> None:
    assert qscheme.QuantLinear is QuantLinear


@pytest.mark.parametrize("scheme_name", ["compressed-tensors/W4A16_ASYM", "modelopt/NVFP4", "compressed-tensors/FP8"])
def test_from_tensors_forward_any_batch_shape_with_bias(scheme_name: str) -> None:
    scheme = builtin_scheme(scheme_name)
    tensors = layer_tensors(scheme, n=64, k=256)
    bias = torch.randn(64)
    layer = QuantLinear.from_tensors(scheme_name, tensors, device="cpu", bias=bias, layer_name="layers.0.mlp.up_proj")
    assert layer.kernel.name == "reference"
    assert (layer.in_features, layer.out_features) == (256, 64)
    weight = layer.dequantize()
    assert weight.dtype == torch.float32 and weight.shape == (64, 256)
    assert torch.equal(weight, dequantize_weight(tensors, scheme))
    for shape in [(256,), (5, 256), (2, 3, 256)]:
        x = torch.randn(*shape)
        y = layer(x)
        assert y.shape == (*shape[:-1], 64) and y.dtype == torch.float32
        if scheme.activation is None:
            torch.testing.assert_close(y, x @ weight.t() + bias, rtol=1e-5, atol=1e-5)
    assert "kernel=reference" in repr(layer)


def test_activation_dtype_changes_resolve_again() -> None:
    tensors = layer_tensors(builtin_scheme("modelopt/W4A16_NVFP4"), n=64, k=256)
    layer = QuantLinear.from_tensors("modelopt/W4A16_NVFP4", tensors, activation_dtype="bf16")
    assert layer.resolution.problem.activation_dtype == "bfloat16"
    y16 = layer(torch.randn(4, 256, dtype=torch.float16))
    assert y16.dtype == torch.float16
    y32 = layer(torch.randn(4, 256))
    assert y32.dtype == torch.float32


def test_forcing_a_kernel_that_cannot_run_raises_with_layer_shape_and_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = layer_tensors(builtin_scheme("compressed-tensors/W4A16"), n=64, k=256)
    with pytest.raises(NoKernelError) as caught:
        QuantLinear.from_tensors("compressed-tensors/W4A16", tensors, kernel="marlin", layer_name="layers.2.o_proj")
    message = str(caught.value)
    assert message.startswith(
        "forced kernel 'marlin' cannot run layer layers.2.o_proj (scheme compressed-tensors/W4A16; N=64, K=256"
    )
    assert re.search(r"\n  marlin +vllm +80 +rejected +device +runs on cuda; device is cpu", message)
    assert "hint: kernel reference can run this layer here" in message
    monkeypatch.setenv("QSCHEME_KERNEL", "marlin")
    with pytest.raises(NoKernelError, match="forced kernel 'marlin'"):
        QuantLinear.from_tensors("compressed-tensors/W4A16", tensors)
    with pytest.raises(UsageError, match="unknown kernel 'nope'"):
        QuantLinear.from_tensors("compressed-tensors/W4A16", tensors, kernel="nope")


def test_nvfp4_weights_with_fp8_inputs_raise_no_kernel() -> None:
    scheme = builtin_scheme("modelopt/W4A8_NVFP4_FP8")
    with pytest.raises(NoKernelError) as caught:
        QuantLinear.from_tensors(scheme, layer_tensors(scheme, n=64, k=256), layer_name="layers.0.mlp.down_proj")
    message = str(caught.value)
    assert "No kernel implements nvfp4 weights with fp8 static per tensor activations." in message
    assert "layer layers.0.mlp.down_proj" in message and "N=64, K=256" in message


def test_fused_layers_with_different_scales_need_per_partition_kernels() -> None:
    scheme = builtin_scheme("compressed-tensors/NVFP4A16")
    members = [canonicalize(scheme, layer_tensors(scheme, n=32, k=128, seed=s)) for s in range(3)]
    fused = concatenate(members)
    problem = problem_for(fused, "bfloat16", "layers.0.self_attn.qkv_proj")
    assert (problem.partitions, problem.partition_scales_differ) == (3, True)

    single_scale = KernelDeclaration(
        "single_scale",
        "test",
        100,
        (Supports(("nvfp4",)),),
        (DeviceSupport(ANY_DEVICE),),
        "qscheme_plugins.reference_kernel:ReferenceKernel",
    )

    class SingleScalePlugin:
        @hookimpl
        def qscheme_kernels(self) -> list[KernelDeclaration]:
            return [single_scale]

    register_plugin(SingleScalePlugin(), "single-scale")
    layer = QuantLinear.from_canonical(fused, device="cpu", layer_name="layers.0.self_attn.qkv_proj")
    assert layer.kernel.name == "reference"
    rejected = layer.resolution.candidate("single_scale")
    assert rejected.stage == "problem" and "3 fused partitions have different scales" in rejected.reason
    x = torch.randn(3, 128)
    separate = torch.cat([x @ dequantize(m).t() for m in members], dim=-1)
    torch.testing.assert_close(layer(x), separate, rtol=1e-5, atol=1e-5)
    # One member alone has one scale: the single-scale kernel takes it.
    assert QuantLinear.from_canonical(members[0]).kernel.name == "single_scale"


def test_bad_inputs_are_typed_errors() -> None:
    scheme = builtin_scheme("compressed-tensors/W4A16")
    tensors = layer_tensors(scheme, n=64, k=256)
    with pytest.raises(QuantizeError, match="missing tensor"):
        QuantLinear.from_tensors(scheme, {k: v for k, v in tensors.items() if k != "weight_scale"})
    with pytest.raises(QuantizeError, match=r"weight_scale \(weight_scale\) has shape \[64, 3\]"):
        QuantLinear.from_tensors(scheme, {**tensors, "weight_scale": torch.ones(64, 3)})
    with pytest.raises(UsageError, match="bias has shape"):
        QuantLinear.from_tensors(scheme, tensors, bias=torch.ones(63))
    layer = QuantLinear.from_tensors(scheme, tensors)
    with pytest.raises(UsageError, match="takes K=256"):
        layer(torch.randn(2, 255))
    with pytest.raises(UsageError, match=r"dtype torch\.float64"):
        layer(torch.randn(2, 256, dtype=torch.float64))
