"""Non-finite inputs to layers that quantize activations: refused on a CPU, NaN rows elsewhere.

Before the check, an inf in an NVFP4 W4A4 input came back as finite, wrong outputs from both
the reference and the Triton kernel, and a NaN did so from the Triton kernel; FP8 dynamic gave
NaN on one kernel and inf on the other.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from kernel_fakes import input_scales

from qscheme import cpu_gemv
from qscheme.catalog import load_scheme
from qscheme.errors import QSchemeError
from qscheme.input_checks import NonFiniteInputError, _all_finite_natively, poison_non_finite_rows, refuse_non_finite
from qscheme.modules import QuantLinear
from qscheme.quantize import quantize_weight

KERNELS = ["reference", "triton"]


def _layer(scheme_name: str, kernel: str, device: str = "cpu") -> QuantLinear:
    scheme = load_scheme(scheme_name)
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    tensors = quantize_weight(weight, scheme, **input_scales(scheme, 4.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return QuantLinear.from_tensors(
            scheme,
            tensors,
            kernel=kernel,
            activation_dtype="float32",
            layer_name="model.layers.3.mlp.up_proj",
            device=device,
        )


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("scheme", ["compressed-tensors/NVFP4", "compressed-tensors/FP8_DYNAMIC"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_cpu_layer_that_quantizes_activations_refuses_non_finite_inputs(scheme: str, kernel: str, bad: float) -> None:
    layer = _layer(scheme, kernel)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    finite = layer(x)
    assert torch.isfinite(finite).all()
    x[1, 5] = bad
    x[2, 60] = bad
    with pytest.raises(NonFiniteInputError) as caught:
        layer(x)
    error = caught.value
    assert isinstance(error, QSchemeError) and isinstance(error, ValueError)
    assert (error.layer, error.count) == ("model.layers.3.mlp.up_proj", 2)
    message = str(error)
    assert message.startswith("model.layers.3.mlp.up_proj: the input holds 2 non-finite value(s)")
    assert f"(first: {bad} at index [1, 5] of [3, 64])" in message and f"scheme {scheme}" in message
    assert "KernelExecutionError" not in type(error).__name__  # not blamed on the kernel


@pytest.mark.parametrize("kernel", KERNELS)
def test_weight_only_layers_propagate_non_finite_inputs(kernel: str) -> None:
    layer = _layer("compressed-tensors/NVFP4A16", kernel)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    x[0, 7] = float("inf")
    y = layer(x)
    assert not torch.isfinite(y[0]).any() and torch.isfinite(y[1]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_off_cpu_the_rows_of_non_finite_inputs_become_nan(dtype: torch.dtype) -> None:
    """What a non-CPU device gets instead of the error (no synchronisation): IEEE-like NaN rows,
    whatever the kernel returned for them; other rows are untouched, bit for bit."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=generator).to(dtype)
    y = torch.randn(5, 32, generator=generator).to(dtype)  # finite, as a clamping kernel returns
    x[1, 0], x[2, 63], x[3, 9] = float("inf"), float("nan"), float("-inf")
    x[4, :] = float("inf")
    out = poison_non_finite_rows(y, x)
    assert out.dtype == dtype
    for row in (1, 2, 3, 4):
        assert torch.isnan(out[row]).all(), row
    assert torch.equal(out[0], y[0])
    batched = poison_non_finite_rows(y.reshape(1, 5, 32), x.reshape(1, 5, 64))
    assert torch.equal(batched.reshape(5, 32)[0], y[0]) and torch.isnan(batched[0, 1]).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("scheme", ["compressed-tensors/NVFP4", "compressed-tensors/FP8_DYNAMIC"])
def test_a_gpu_layer_gives_nan_rows_for_non_finite_inputs(scheme: str) -> None:
    layer = _layer(scheme, "triton", device="cuda")  # built there: on a CPU triton needs the interpreter
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4)).cuda()
    clean = layer(x)
    x[1, 5] = float("inf")
    x[2, 9] = float("nan")
    y = layer(x)
    assert torch.isnan(y[1]).all() and torch.isnan(y[2]).all()
    assert torch.equal(y[0], clean[0])


@pytest.mark.skipif(not cpu_gemv.available(), reason="qscheme._cpu_gemv is not built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("isa", ["scalar", "avx512"])
def test_the_native_finite_pass_finds_every_inf_and_nan(dtype: torch.dtype, isa: str) -> None:
    """The extension's one-pass check against torch.isfinite: each position of ragged lengths (the
    vector loop's tails), the largest finite values and subnormals (finite), inf and NaN."""
    if isa == "avx512" and cpu_gemv.supported_isa() != "avx512":
        pytest.skip("this CPU has no AVX-512")
    before = cpu_gemv.isa()
    cpu_gemv.set_isa(isa)
    try:
        info = torch.finfo(dtype)
        for n in (1, 15, 17, 31, 33, 64, 100):
            x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
            x[0] = info.max
            x[n // 2] = -info.tiny / 2  # a subnormal
            assert _all_finite_natively(x)
            for position in range(n):
                for bad in (float("inf"), float("-inf"), float("nan")):
                    y = x.clone()
                    y[position] = bad
                    assert not _all_finite_natively(y), (n, position, bad)
    finally:
        cpu_gemv.set_isa(before)


@pytest.mark.skipif(not cpu_gemv.available(), reason="qscheme._cpu_gemv is not built here")
def test_inputs_the_native_pass_does_not_take_are_checked_by_torch() -> None:
    """A strided view or a float64 input: the native pass declines (False), and the refusal still
    comes with its count and first position."""
    x = torch.randn(4, 64)
    x[3, 2] = float("nan")
    strided = x[:, ::2]
    assert not _all_finite_natively(strided) and not _all_finite_natively(x.double())
    with pytest.raises(NonFiniteInputError, match=r"1 non-finite value\(s\) \(first: nan at index \[3, 1\]"):
        refuse_non_finite(strided, "layer", "scheme")
    with pytest.raises(NonFiniteInputError, match=r"at index \[3, 2\] of \[4, 64\]"):
        refuse_non_finite(x.double(), "layer", "scheme")
    refuse_non_finite(torch.randn(4, 64)[:, ::2], "layer", "scheme")  # finite: no error
