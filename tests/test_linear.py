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
from qscheme.modules import QuantLinear, problem_for
from qscheme.plugins import hookimpl, register_plugin


@pytest.fixture(autouse=True)
def builtin_kernels_without_triton(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Built-in plugins only; Triton (interpreted on CPU, slow) is disabled unless a test forces it.

    tinygemm_cpu and cpu_gemv are disabled too: they would take the int4, NVFP4 and FP8 layers,
    and these tests are about QuantLinear's mechanics, run on the reference kernel
    (tests/test_tinygemm.py and tests/test_cpu_gemv.py test those kernels through QuantLinear)."""
    monkeypatch.setenv("QSCHEME_DISABLED_KERNELS", "triton,tinygemm_cpu,cpu_gemv")
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


def _awq(n: int = 32, k: int = 256) -> QuantLinear:
    generator = torch.Generator().manual_seed(3)
    tensors = qscheme.quantize_weight(
        torch.randn(n, k, generator=generator),
        "modelopt/W4A16_AWQ",
        pre_quant_scale=torch.rand(k, generator=generator) + 0.5,
    )
    return QuantLinear.from_tensors("modelopt/W4A16_AWQ", tensors, bias=torch.randn(n, generator=generator))


@pytest.mark.parametrize(
    "scheme_name", ["compressed-tensors/NVFP4A16", "compressed-tensors/MXFP4A16", "compressed-tensors/FP8_DYNAMIC"]
)
def test_the_input_gets_its_gradient_through_the_weight(scheme_name: str) -> None:
    layer = QuantLinear.from_tensors(scheme_name, qscheme.quantize_weight(torch.randn(32, 64), scheme_name))
    x = torch.randn(2, 3, 64, requires_grad=True)
    y = layer(x)
    torch.testing.assert_close(y, layer(x.detach()), rtol=0, atol=0)  # the kernel's output, unchanged
    grad_y = torch.randn_like(y)
    y.backward(grad_y)
    assert x.grad is not None
    # weight-only: exactly the float layer's gradient; activation-quantized: straight through
    torch.testing.assert_close(x.grad, grad_y @ layer.dequantize(), rtol=1e-6, atol=1e-6)
    assert not any(t.requires_grad for t in layer.state_dict().values())  # the weight is frozen


def test_awq_applies_its_pre_scale_in_the_effective_weight_and_the_gradient() -> None:
    layer = _awq()
    pre_scale = layer.weight_canonical.input_pre_scale
    assert pre_scale is not None
    x = torch.randn(4, 256, requires_grad=True)
    y = layer(x)
    effective = layer.effective_weight()
    torch.testing.assert_close(effective, layer.dequantize() * pre_scale[None, :])
    assert float((y.detach() - (x.detach() @ layer.dequantize().t() + layer.bias)).abs().max()) > 1e-2  # not W alone
    torch.testing.assert_close(y, x.detach() @ effective.t() + layer.bias, rtol=1e-5, atol=1e-5)
    y.sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, torch.ones(4, 32) @ effective, rtol=1e-6, atol=1e-6)


def test_state_dict_holds_the_canonical_tensors_and_loads_them() -> None:
    source = QuantLinear.from_tensors("compressed-tensors/NVFP4A16", _nvfp4a16(), bias=torch.randn(32))
    target = QuantLinear.from_tensors("compressed-tensors/NVFP4A16", _nvfp4a16(), bias=torch.randn(32))
    state = source.state_dict()
    assert set(state) == {
        "bias",
        "canonical_codes",
        "canonical_scale",
        "canonical_global_scale",
        "canonical_global_scale_divisor",
    }
    x = torch.randn(3, 64)
    before = target.prepare(torch.float32)(x)  # prepared: its kernel state must be rebuilt on load
    assert str(target.load_state_dict(state, strict=True)) == "<All keys matched successfully>"
    after = target(x)
    assert not torch.equal(before, after)
    torch.testing.assert_close(after, source(x), rtol=0, atol=0)
    torch.testing.assert_close(target.dequantize(), source.dequantize(), rtol=0, atol=0)


def test_load_state_dict_refuses_other_dtypes_and_shapes_without_copying() -> None:
    target = QuantLinear.from_tensors("compressed-tensors/NVFP4A16", _nvfp4a16(), layer_name="q")
    kept = target.dequantize()
    other_shape = QuantLinear.from_tensors("compressed-tensors/NVFP4A16", _nvfp4a16(n=64)).state_dict()
    with pytest.raises(
        RuntimeError, match=r"canonical_codes: uint8 \[64, 32\] cannot be loaded into uint8 \[32, 32\] of q"
    ):
        target.load_state_dict(other_shape)
    # another layer's tensors with e8m0-like bytes where this scheme keeps e4m3 scales
    state = {
        **QuantLinear.from_tensors("compressed-tensors/NVFP4A16", _nvfp4a16()).state_dict(),
        "canonical_scale": torch.full((32, 4), 127, dtype=torch.uint8),
    }
    expected = (
        r"canonical_scale: uint8 \[32, 4\] cannot be loaded into float8_e4m3fn \[32, 4\] of q "
        r"\(canonical tensors of scheme compressed-tensors/NVFP4A16, N=32, K=64\)"
    )
    with pytest.raises(RuntimeError, match=expected):
        target.load_state_dict(state)
    torch.testing.assert_close(target.dequantize(), kept, rtol=0, atol=0)  # nothing cast or copied in
    missing = {k: v for k, v in target.state_dict().items() if k != "canonical_global_scale"}
    with pytest.raises(RuntimeError, match=r'Missing key.*"canonical_global_scale"'):
        target.load_state_dict(missing)


def test_dtype_casts_leave_the_quantized_weight_and_device_moves_take_it() -> None:
    layer = QuantLinear.from_tensors("compressed-tensors/NVFP4A16", _nvfp4a16(), bias=torch.randn(32))
    dtypes = {name: value.dtype for name, value in layer.state_dict().items()}
    x = torch.randn(2, 64)
    expected = layer(x)
    layer.half()
    assert layer.bias is not None and layer.bias.dtype == torch.float16  # as an nn.Linear's bias
    assert {n: v.dtype for n, v in layer.state_dict().items() if n != "bias"} == {
        n: d for n, d in dtypes.items() if n != "bias"
    }
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=1e-2)  # only the bias was rounded
    layer.float()
    meta = layer.to("meta")
    assert meta is layer and layer.torch_device == torch.device("meta")
    assert all(value.is_meta for value in layer.state_dict().values())
    with pytest.raises(UsageError, match="the input is on cpu, the layer on meta"):
        layer(x)
    with pytest.raises(UsageError, match="the layer is on the meta device, which holds no values to compute with"):
        layer(x.to("meta"))


def test_autocast_computes_in_its_dtype_as_nn_linear_does() -> None:
    layer = QuantLinear.from_tensors("compressed-tensors/NVFP4A16", _nvfp4a16(), bias=torch.randn(32))
    x = torch.randn(2, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
        assert torch.nn.functional.linear(x, torch.randn(32, 64)).dtype == y.dtype == torch.bfloat16
    torch.testing.assert_close(y, layer(x.bfloat16()), rtol=0, atol=0)
    assert layer(x).dtype == torch.float32  # outside autocast, the input's dtype


def test_a_partial_set_of_canonical_tensors_is_refused_even_when_not_strict() -> None:
    target = QuantLinear.from_tensors("compressed-tensors/NVFP4A16", _nvfp4a16(), layer_name="q")
    kept = target.dequantize()
    other = QuantLinear.from_tensors("compressed-tensors/NVFP4A16", _nvfp4a16()).state_dict()
    partial = {name: value for name, value in other.items() if name != "canonical_scale"}
    with pytest.raises(
        RuntimeError, match=r"canonical_scale: missing beside canonical_codes, .*load together or not at all"
    ):
        target.load_state_dict(partial, strict=False)
    torch.testing.assert_close(target.dequantize(), kept, rtol=0, atol=0)


def test_assigning_a_state_dict_to_a_layer_on_the_meta_device_puts_it_where_the_tensors_are() -> None:
    source = QuantLinear.from_tensors("compressed-tensors/NVFP4A16", _nvfp4a16(), bias=torch.randn(32))
    x = torch.randn(2, 64)
    expected = source(x)
    import copy

    source.prepare()
    shell = copy.deepcopy(source).to("meta")
    assert shell.torch_device.type == "meta" and not shell.prepared
    shell.load_state_dict(source.state_dict(), assign=True)
    assert shell.torch_device == torch.device("cpu")
    torch.testing.assert_close(shell(x), expected, rtol=0, atol=0)


def test_kernel_choice_and_state_follow_the_layers_device() -> None:
    layer = QuantLinear.from_tensors("compressed-tensors/NVFP4A16", _nvfp4a16()).prepare()
    assert layer.prepared and layer.torch_device == torch.device("cpu")
    canonical = {name: value.data_ptr() for name, value in layer.state_dict().items()}
    # the device buffer alone changes, as on a move to a GPU (the canonical tensors stay on the
    # host) or after torch.load(map_location=...): what was chosen and prepared for the CPU goes
    layer._device_anchor = torch.empty(0, device="meta")
    assert layer.torch_device.type == "meta" and not layer.prepared
    assert {name: value.data_ptr() for name, value in layer.state_dict().items()} == canonical  # not moved


def test_float64_is_refused_under_autocast_too() -> None:
    layer = QuantLinear.from_tensors("compressed-tensors/NVFP4A16", _nvfp4a16())
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(UsageError, match=r"input dtype torch\.float64"):
        layer(torch.randn(2, 64, dtype=torch.float64))


def test_the_meta_flow_builds_the_same_layer_from_a_state_dict() -> None:
    import copy

    source = QuantLinear.from_tensors(
        "compressed-tensors/W4A16", qscheme.quantize_weight(torch.randn(32, 256), "compressed-tensors/W4A16")
    )
    shell = copy.deepcopy(source).to("meta").to_empty(device="cpu")
    assert shell.torch_device == torch.device("cpu")
    shell.load_state_dict(source.state_dict(), strict=True)
    x = torch.randn(2, 256)
    torch.testing.assert_close(shell(x), source(x), rtol=0, atol=0)


def test_pickling_leaves_the_kernel_state_behind() -> None:
    import copy
    import io

    layer = QuantLinear.from_tensors("compressed-tensors/NVFP4A16", _nvfp4a16()).prepare()
    assert layer.prepared
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    twin = copy.deepcopy(layer)
    assert not loaded.prepared and not twin.prepared and layer.prepared
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(loaded(x), layer(x), rtol=0, atol=0)
    torch.testing.assert_close(twin(x), layer(x), rtol=0, atol=0)


def test_threads_that_run_the_first_forward_together_prepare_once() -> None:
    import threading

    layer = QuantLinear.from_tensors("compressed-tensors/NVFP4A16", _nvfp4a16())
    implementation = layer._resolve("float32")[2]
    calls = []
    original = implementation.prepare

    def counting(*arguments: object) -> object:
        calls.append(1)
        return original(*arguments)

    implementation.prepare = counting  # this layer's resolved kernel instance only
    barrier = threading.Barrier(8)
    outputs: list[torch.Tensor] = []
    x = torch.randn(2, 64)

    def first_forward() -> None:
        barrier.wait()
        outputs.append(layer(x))

    threads = [threading.Thread(target=first_forward) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(outputs) == 8
    assert all(torch.equal(y, outputs[0]) for y in outputs)


def test_torch_compile_prepares_eagerly_and_traces_a_prepared_layer_whole() -> None:
    tensors = _nvfp4a16()
    x = torch.randn(2, 64)
    expected = QuantLinear.from_tensors("compressed-tensors/NVFP4A16", tensors)(x)
    torch._dynamo.reset()
    unprepared = QuantLinear.from_tensors("compressed-tensors/NVFP4A16", tensors)
    torch.testing.assert_close(torch.compile(unprepared, backend="eager")(x), expected, rtol=0, atol=0)
    assert unprepared._states  # prepared by the first compiled call, outside the graph
    prepared = QuantLinear.from_tensors("compressed-tensors/NVFP4A16", tensors).prepare(torch.float32)
    whole = torch.compile(prepared, backend="eager", fullgraph=True)
    torch.testing.assert_close(whole(x), expected, rtol=0, atol=0)


def test_cpu_with_an_index_is_the_cpu() -> None:
    layer = QuantLinear.from_tensors("compressed-tensors/NVFP4A16", _nvfp4a16(), device="cpu:0")
    assert layer.torch_device == torch.device("cpu")
    x = torch.randn(2, 64)
    torch.testing.assert_close(layer(x), x @ layer.dequantize().t())


def test_weight_answers_device_kind_and_refuses_replacement() -> None:
    """``.weight.is_meta`` / ``is_cpu`` answer for the layer's device (as ``.device`` does), and
    assigning ``.weight`` (weight tying, resizing) is a typed error naming the layer."""
    from qscheme.modules import QuantizedWeightError

    scheme = builtin_scheme("compressed-tensors/W4A16")
    layer = QuantLinear.from_tensors(scheme, layer_tensors(scheme, n=64, k=256), device="cpu", layer_name="lm_head")
    weight = layer.weight
    assert (weight.is_meta, weight.is_cpu, weight.is_cuda) == (False, True, False)
    assert weight.device == torch.device("cpu") and weight.shape == (64, 256)
    with pytest.raises(QuantizedWeightError, match=r"lm_head: \.weight of a quantized layer cannot be replaced"):
        layer.weight = torch.nn.Parameter(torch.zeros(64, 256))
    layer.bias = None  # other attributes are set as on any module
