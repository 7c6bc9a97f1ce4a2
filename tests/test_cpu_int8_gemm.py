"""The ``cpu_int8_gemm`` kernel (``qscheme._int8_gemm``, C++) against the reference kernel.

compressed-tensors W8A8 layers, quantized from random weights by qscheme's quantizer and
canonicalized as a loaded checkpoint is, run on the portable and (where this CPU has AVX512-VNNI)
the VNNI loops: ragged N and K, M = 0, 1, a 3-D input, rows on both sides of the panel path's
start (16), bias, bfloat16 and float32 inputs. The bound is the declaration's: per output,
(K + 8) * 2**-24 * sum_k |x_k w_k| (x as the reference multiplies it, quantized and dequantized),
plus one unit in the last place of each side's bfloat16 output. Fused partitions equal the
separate layers bit for bit; the state keeps the canonical codes; the resolver's plan on a CPU;
the checks' reasons; typed refusals.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from kernel_fakes import all_modules, builtin_scheme, fake_device, layer_tensors
from qscheme_plugins.cpu_int8_gemm import CPU_INT8_GEMM, MAX_K, ExactSums, Int8Loops
from qscheme_plugins.cpu_int8_gemm_kernel import CpuInt8GemmKernel
from qscheme_plugins.reference_kernel import ReferenceKernel
from test_int8_gemm import isa  # noqa: F401  (the fixture: every loop this CPU runs)

from qscheme import int8_gemm
from qscheme.canonical import CanonicalWeight, canonicalize, dequantize
from qscheme.checkpoint.fuse import concatenate
from qscheme.errors import UsageError
from qscheme.kernels import registry
from qscheme.kernels.problem import Problem
from qscheme.kernels.resolver import resolve
from qscheme.modules import QuantLinear

pytestmark = pytest.mark.skipif(not int8_gemm.available(), reason="qscheme._int8_gemm is not built")

CPU = torch.device("cpu")
NAME = "compressed-tensors/W8A8"
BF16, FP32 = torch.bfloat16, torch.float32
SHAPES = ((37, 200), (64, 256), (5, 20), (70, 4099))
# (input shape without K, dtype, bias): M = 1, 4, a 3-D input, 15 and 16 rows (the panel path from 16), 40, M = 0
CASES = (
    ((1,), BF16, True),
    ((1,), FP32, False),
    ((4,), BF16, False),
    ((2, 3), FP32, True),
    ((15,), BF16, True),
    ((16,), BF16, False),
    ((40,), FP32, True),
    ((0,), BF16, True),
)


@functools.cache
def weight_of(n: int, k: int, seed: int = 0) -> CanonicalWeight:
    scheme = builtin_scheme(NAME)
    return canonicalize(scheme, layer_tensors(scheme, n=n, k=k, seed=seed), n, k)


def check_close(weight: CanonicalWeight, x: torch.Tensor, y: torch.Tensor, expected: torch.Tensor) -> None:
    assert y.shape == expected.shape and y.dtype == expected.dtype == x.dtype
    reference = ReferenceKernel()
    (_, given), *_ = reference.quantize_input(reference.prepare(weight, CPU), x.reshape(-1, weight.k))
    magnitude = given.double().abs() @ dequantize(weight).double().abs().t()
    bound = (weight.k + 8) * 2.0**-24 * magnitude.reshape(y.shape)
    if x.dtype == BF16:
        bound = bound + 2.0**-7 * torch.maximum(y.double().abs(), expected.double().abs())
    error = (y.double() - expected.double()).abs()
    assert bool((error <= bound + 1e-30).all()), f"largest excess {float((error - bound).max()):.3e}"


@pytest.mark.usefixtures("isa")
def test_matches_the_reference_kernel() -> None:
    kernel, reference = CpuInt8GemmKernel(), ReferenceKernel()
    generator = torch.Generator().manual_seed(3)
    for n, k in SHAPES:
        weight = weight_of(n, k)
        state, expected_state = kernel.prepare(weight, CPU), reference.prepare(weight, CPU)
        bias = torch.randn(n, generator=generator)
        for shape, dtype, with_bias in CASES:
            x = torch.randn((*shape, k), generator=generator).to(dtype)
            b = bias.to(dtype) if with_bias else None
            check_close(weight, x, kernel.apply(state, x, b), reference.apply(expected_state, x, b))


@pytest.mark.usefixtures("isa")
def test_fused_partitions_equal_the_separate_layers() -> None:
    members = [weight_of(rows, 96, seed) for rows, seed in ((16, 1), (32, 2), (8, 3))]
    fused = concatenate(members)
    kernel = CpuInt8GemmKernel()
    for rows in (3, 20):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(BF16)
        y = kernel.apply(kernel.prepare(fused, CPU), x, None)
        assert torch.equal(y, torch.cat([kernel.apply(kernel.prepare(m, CPU), x, None) for m in members], dim=-1))
        reference = ReferenceKernel()
        check_close(fused, x, y, reference.apply(reference.prepare(fused, CPU), x, None))


def test_the_state_is_the_canonical_codes() -> None:
    weight = weight_of(64, 256)
    layer = CpuInt8GemmKernel().prepare(weight, CPU).layer
    assert layer.codes.untyped_storage().data_ptr() == weight.codes.untyped_storage().data_ptr()
    extra = layer.sums.numel() * layer.sums.element_size() + layer.scale.numel() * layer.scale.element_size()
    assert extra == 8 * weight.n
    # the scales it multiplies are the reference's: code * scale is the dequantized weight, bit for bit
    assert torch.equal(weight.codes.float() * layer.scale.reshape(-1, 1), dequantize(weight))


def test_quant_linear_runs_it() -> None:
    if Int8Loops().check(Problem(64, 256)).ok is False:
        pytest.skip("this CPU lacks AVX512-VNNI: the kernel is not offered")
    weight = weight_of(64, 256)
    bias = torch.randn(64)
    layer = QuantLinear.from_canonical(weight, kernel="cpu_int8_gemm", bias=bias)
    x = torch.randn(2, 3, 256).to(BF16)
    expected = QuantLinear.from_canonical(weight, kernel="reference", bias=bias)(x)
    check_close(weight, x, layer(x), expected)


def test_the_resolver_plans_every_m_on_it() -> None:
    device = fake_device("cpu", modules=all_modules() | {CPU_INT8_GEMM.implementation_module or ""})
    declarations = registry.declarations()
    resolution = resolve(builtin_scheme(NAME), Problem(4096, 4096), device, declarations)
    assert resolution.kernel is not None
    if int8_gemm.supported_isa() == "vnni":
        assert resolution.kernel.name == "cpu_int8_gemm"
        assert resolution.candidate("cpu_int8_gemm").chosen
    else:
        assert "AVX512-VNNI" in resolution.candidate("cpu_int8_gemm").reason
    fp16 = resolve(builtin_scheme(NAME), Problem(4096, 4096, "float16"), device, declarations)
    assert "takes bfloat16 or float32 activations" in fp16.candidate("cpu_int8_gemm").reason
    without = resolve(builtin_scheme(NAME), Problem(4096, 4096), device, declarations, disabled=["cpu_int8_gemm"])
    assert without.kernel is not None and without.kernel.name == "cpu_gemv"


def test_the_checks_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    problem = Problem(64, 256)
    assert Int8Loops().check(problem).ok == (int8_gemm.supported_isa() == "vnni")
    monkeypatch.setattr(int8_gemm, "supported_isa", lambda: "scalar")
    result = Int8Loops().check(problem)
    assert not result.ok and "lacks AVX512-VNNI" in result.reason and "cpu_gemv" in result.hint
    monkeypatch.setattr(int8_gemm, "available", lambda: False)
    result = Int8Loops().check(problem)
    assert not result.ok and "qscheme._int8_gemm is not built" in result.reason and "C++17" in result.hint
    assert ExactSums().check(Problem(8, MAX_K)).ok
    result = ExactSums().check(Problem(8, MAX_K + 1))
    assert not result.ok and f"K={MAX_K + 1}" in result.reason and "split the layer" in result.hint


def test_refusals_are_typed() -> None:
    weight = weight_of(64, 256)
    kernel = CpuInt8GemmKernel()
    state = kernel.prepare(weight, CPU)
    with pytest.raises(UsageError, match="K=256"):
        kernel.apply(state, torch.randn(3, 128), None)
    with pytest.raises(UsageError, match=r"bfloat16 or float32 inputs, not torch\.float16"):
        kernel.apply(state, torch.randn(3, 256).half(), None)
    with pytest.raises(UsageError, match="runs on the CPU"):
        kernel.prepare(weight, torch.device("meta"))
    with pytest.raises(UsageError, match="symmetric int8 weights"):
        kernel.prepare(replace(weight, zero_point=torch.zeros(64, 1, dtype=torch.int8)), CPU)
