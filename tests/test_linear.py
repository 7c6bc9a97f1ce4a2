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
    with pytest.raises(QuantizeError, match="tensor 'weight_scale': missing: scheme compressed-tensors/W4A16 declares"):
        QuantLinear.from_tensors(scheme, {k: v for k, v in tensors.items() if k != "weight_scale"})
    with pytest.raises(
        QuantizeError, match=r"'weight_scale': expected shape .* = \[64, 2\] for N=64, K=256.*\[64, 3\]"
    ):
        QuantLinear.from_tensors(scheme, {**tensors, "weight_scale": torch.ones(64, 3)})
    with pytest.raises(UsageError, match="bias has shape"):
        QuantLinear.from_tensors(scheme, tensors, bias=torch.ones(63))
    layer = QuantLinear.from_tensors(scheme, tensors)
    with pytest.raises(UsageError, match="takes K=256"):
        layer(torch.randn(2, 255))
    with pytest.raises(UsageError, match=r"dtype torch\.float64"):
        layer(torch.randn(2, 256, dtype=torch.float64))


# -- given tensors get the checkpoint loader's checks -------------------------------------------


def _nvfp4a16(n: int = 32, k: int = 64) -> dict[str, torch.Tensor]:
    return qscheme.quantize_weight(torch.randn(n, k), "compressed-tensors/NVFP4A16")


def test_a_misspelt_optional_tensor_is_refused_not_dropped() -> None:
    tensors = qscheme.quantize_weight(torch.randn(32, 256), "modelopt/W4A16_AWQ", pre_quant_scale=torch.rand(256) + 0.5)
    assert "pre_quant_scale" in tensors
    misspelt = {("pre_quant_scales" if k == "pre_quant_scale" else k): v for k, v in tensors.items()}
    with pytest.raises(QuantizeError, match=r"tensor 'pre_quant_scales': unexpected for scheme modelopt/W4A16_AWQ"):
        QuantLinear.from_tensors("modelopt/W4A16_AWQ", misspelt)
    with pytest.raises(QuantizeError, match="'pre_quant_scales': unexpected"):
        dequantize_weight(misspelt, "modelopt/W4A16_AWQ")


@pytest.mark.parametrize("value", [0.0, -2.0, float("nan"), float("inf")])
def test_a_bad_global_scale_is_refused(value: float) -> None:
    tensors = _nvfp4a16()
    tensors["weight_global_scale"] = torch.full_like(tensors["weight_global_scale"], value)
    pattern = (
        r"layer q, scheme compressed-tensors/NVFP4A16: 1 problem.*"
        r"tensor 'q.weight_global_scale': expected a finite scale > 0"
    )
    with pytest.raises(QuantizeError, match=re.compile(pattern, re.S)):
        QuantLinear.from_tensors("compressed-tensors/NVFP4A16", tensors, layer_name="q")
    with pytest.raises(QuantizeError, match="expected a finite scale > 0"):
        dequantize_weight(tensors, "compressed-tensors/NVFP4A16")


def test_nan_block_scales_wrong_dtypes_and_shapes_are_refused() -> None:
    tensors = _nvfp4a16()
    nan = tensors["weight_scale"].clone()
    nan.view(torch.uint8)[0, 0] = 0x7F  # e4m3 NaN
    with pytest.raises(
        QuantizeError, match=r"'weight_scale': expected finite scales, found 1 NaN/inf value \(first: nan at \[0, 0\]\)"
    ):
        QuantLinear.from_tensors("compressed-tensors/NVFP4A16", {**tensors, "weight_scale": nan})
    floats = tensors["weight_packed"].to(torch.float32)
    with pytest.raises(QuantizeError, match="'weight_packed': expected dtype uint8, found float32"):
        dequantize_weight({**tensors, "weight_packed": floats}, "compressed-tensors/NVFP4A16")
    transposed = tensors["weight_scale"].t().contiguous()
    with pytest.raises(QuantizeError, match=r"'weight_scale': expected shape .* = \[32, 4\] .*found \[4, 32\]"):
        dequantize_weight({**tensors, "weight_scale": transposed}, "compressed-tensors/NVFP4A16")
    with pytest.raises(QuantizeError, match=r"'weight_global_scale': expected shape"):
        dequantize_weight({**tensors, "weight_global_scale": torch.ones(2)}, "compressed-tensors/NVFP4A16")


def test_a_bad_weight_shape_tensor_is_refused() -> None:
    tensors = qscheme.quantize_weight(torch.randn(24, 200), "compressed-tensors/W4A16")
    with pytest.raises(QuantizeError, match="'weight_shape': expected shape"):
        QuantLinear.from_tensors("compressed-tensors/W4A16", {**tensors, "weight_shape": torch.tensor([24, 200, 1])})
    with pytest.raises(QuantizeError, match=r"'weight_shape' holds \[0, 200\]; expected two positive sizes"):
        dequantize_weight({**tensors, "weight_shape": torch.tensor([0, 200])}, "compressed-tensors/W4A16")


def test_given_tensors_must_be_a_mapping_of_tensors() -> None:
    tensors = _nvfp4a16()
    with pytest.raises(QuantizeError, match="tensors must be a mapping of checkpoint names to tensors"):
        QuantLinear.from_tensors("compressed-tensors/NVFP4A16", list(tensors.values()))  # type: ignore[arg-type]
    with pytest.raises(QuantizeError, match=r"'weight_scale' must be a torch\.Tensor, not list"):
        dequantize_weight({**tensors, "weight_scale": [[1.0]]}, "compressed-tensors/NVFP4A16")  # type: ignore[dict-item]


def test_a_bias_among_the_tensors_is_the_layers_bias() -> None:
    tensors = _nvfp4a16()
    bias = torch.randn(32)
    layer = QuantLinear.from_tensors("compressed-tensors/NVFP4A16", {**tensors, "bias": bias})
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), x @ layer.dequantize().t() + bias)
    with pytest.raises(UsageError, match="bias given twice"):
        QuantLinear.from_tensors("compressed-tensors/NVFP4A16", {**tensors, "bias": bias}, bias=bias)


# -- devices and inputs --------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["gpu", "bogus", None, "meta"])
def test_a_bad_device_is_a_usage_error(device: object) -> None:
    with pytest.raises(UsageError, match="device"):
        QuantLinear.from_tensors("compressed-tensors/NVFP4A16", _nvfp4a16(), device=device)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_cuda_without_a_gpu_fails_when_the_layer_is_built() -> None:
    with pytest.raises(UsageError, match="no CUDA device is visible here"):
        QuantLinear.from_tensors("compressed-tensors/NVFP4A16", _nvfp4a16(), device="cuda")


def test_a_bad_activation_dtype_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="activation dtype 'int8' is not supported"):
        QuantLinear.from_tensors("compressed-tensors/NVFP4A16", _nvfp4a16(), activation_dtype="int8")


def test_forward_refuses_what_it_cannot_compute() -> None:
    layer = QuantLinear.from_tensors("compressed-tensors/NVFP4A16", _nvfp4a16(), layer_name="q")
    with pytest.raises(UsageError, match=r"q: the input must be a torch\.Tensor, not list"):
        layer([[0.0] * 64])  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"q: input of shape \[\] has no features"):
        layer(torch.tensor(1.0))
    with pytest.raises(UsageError, match="q: the input is on meta, the layer on cpu"):
        layer(torch.empty(2, 64, device="meta"))


@pytest.mark.parametrize(
    "scheme_name", ["compressed-tensors/NVFP4A16", "compressed-tensors/MXFP4A16", "compressed-tensors/FP8_DYNAMIC"]
)
def test_the_output_carries_no_gradient_whatever_the_scheme(scheme_name: str) -> None:
    layer = QuantLinear.from_tensors(scheme_name, qscheme.quantize_weight(torch.randn(32, 64), scheme_name))
    x = torch.randn(2, 64, requires_grad=True)
    y = layer(x)
    assert not y.requires_grad
    torch.testing.assert_close(y, layer(x.detach()))


def test_cpu_with_an_index_is_the_cpu() -> None:
    layer = QuantLinear.from_tensors("compressed-tensors/NVFP4A16", _nvfp4a16(), device="cpu:0")
    assert layer.torch_device == torch.device("cpu")
    x = torch.randn(2, 64)
    torch.testing.assert_close(layer(x), x @ layer.dequantize().t())
