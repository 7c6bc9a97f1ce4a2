"""The native FP8 kernels (qscheme_plugins.native_fp8): exact activation quantization, every
claimed scheme against the reference kernel, the exact torch calls validated on the meta device,
and resolution on simulated devices.

Without a GPU the CUDA kernels' prepare/apply run on the CPU as far as torch allows: torch's CPU
``_scaled_mm`` runs tensor-wise and row-wise scaling (so ``native_fp8`` and
``native_fp8_rowwise`` run end to end), and their whole ``apply`` also runs on the meta device,
whose checks are CUDA's (row-major x column-major operands, K and N multiples of 16, scale
shapes, strides and dtypes). ``native_fp8_block``'s ``torch.nn.functional.scaled_mm`` does not
run on a CPU: it is validated on the meta device and its result emulated from the operands the
kernel hands it. The ``gpu`` tests compare every kernel with the reference on CUDA.

Tolerance, elementwise, as each declaration's notes state it (y_ref: the reference kernel's
output, x and w the quantized input and weight as the reference dequantizes them):

- ``native_fp8``, ``native_fp8_cpu`` (float32 GEMM output, or the CPU's bias-then-one-rounding):
  ``|y - y_ref| <= A * sum_k |x_k * w_k| + u * |y_ref|``, u one output ulp: 0 for float32,
  2**-7 for bf16, 2**-10 for fp16;
- ``native_fp8_rowwise``, ``native_fp8_block`` (the GEMM writes bf16, the bias is added after):
  ``|y - y_ref| <= A * sum_k |x_k * w_k| + 3 * 2**-8 * (|y_ref| + |bias|)`` for bf16 and fp16;

with A = 2**-16 on the CPU (float32 accumulation order) and 2**-12 on CUDA (tensor-core FP8
accumulation).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
import torch
from kernel_fakes import ALL_FEATURES, all_modules, builtin_scheme, fake_device, layer_tensors
from qscheme_plugins.native_fp8 import (
    NATIVE_FP8,
    NATIVE_FP8_BLOCK,
    NATIVE_FP8_CPU,
    NATIVE_FP8_ROWWISE,
    qscheme_kernels,
)
from qscheme_plugins.native_fp8_kernel import (
    Fp8State,
    NativeFp8BlockKernel,
    NativeFp8CpuKernel,
    NativeFp8Kernel,
    NativeFp8RowwiseKernel,
    quantize_per_group,
    quantize_per_token,
    quantize_static,
)
from qscheme_plugins.reference import REFERENCE
from qscheme_plugins.reference_kernel import ReferenceKernel
from qscheme_plugins.triton_declaration import TRITON
from torch.nn import functional

from qscheme.canonical import CanonicalWeight, canonicalize, dequantize
from qscheme.checkpoint.fuse import concatenate
from qscheme.descriptor import Scheme, parse_scheme_text
from qscheme.emulation import quantize_activation
from qscheme.errors import UsageError
from qscheme.kernels.declaration import KernelDeclaration
from qscheme.kernels.devices import DeviceFacts, with_environment
from qscheme.kernels.interface import KernelImplementation
from qscheme.kernels.problem import Problem
from qscheme.kernels.registry import load_implementation
from qscheme.kernels.resolver import resolve
from qscheme.modules import QuantLinear

CPU = torch.device("cpu")
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
CPU_ACCUMULATION = 2.0**-16
CUDA_ACCUMULATION = 2.0**-12
OUTPUT_ULP = {FP32: 0.0, BF16: 2.0**-7, FP16: 2.0**-10}

# Channel weights x static per-tensor inputs, and tensor weights x dynamic per-token inputs:
# claimed by native_fp8_rowwise and native_fp8_cpu, stored by no built-in scheme.
CHANNEL_STATIC = parse_scheme_text(
    """
name: test/FP8_CHANNEL_STATIC
weight:
  format: e4m3
  tensor: {name: weight, dtype: float8_e4m3fn, shape: [N, K]}
  scale:
    granularity: channel
    format: float
    stored: multiplier
    tensor: {name: weight_scale, dtype: [float32, bfloat16], shape: [N, 1]}
activation:
  format: e4m3
  granularity: tensor
  dynamic: false
  scale:
    stored: multiplier
    tensor: {name: input_scale, dtype: float32, shape: [1]}
"""
)
TENSOR_PER_TOKEN = parse_scheme_text(
    """
name: test/FP8_TENSOR_PER_TOKEN
weight:
  format: e4m3
  tensor: {name: weight, dtype: float8_e4m3fn, shape: [N, K]}
  scale:
    granularity: tensor
    format: float
    stored: multiplier
    tensor: {name: weight_scale, dtype: float32, shape: [1]}
activation:
  format: e4m3
  granularity: token
  dynamic: true
  scale_format: fp32
"""
)


def scheme_named(name: str) -> Scheme:
    return {s.name: s for s in (CHANNEL_STATIC, TENSOR_PER_TOKEN)}.get(name) or builtin_scheme(name)


# kernel -> (implementation, claimed schemes, activation dtypes)
TENSOR_SCHEMES = ["compressed-tensors/FP8", "modelopt/FP8"]
ROW_SCHEMES = ["compressed-tensors/FP8_DYNAMIC", CHANNEL_STATIC.name, TENSOR_PER_TOKEN.name]
BLOCK_PRODUCER_SCHEMES = ["fp8/FP8_BLOCK", "fp8/FP8_BLOCK_UE8M0"]
KERNELS: dict[str, tuple[Callable[[], KernelImplementation], list[str], list[torch.dtype]]] = {
    "native_fp8": (NativeFp8Kernel, TENSOR_SCHEMES, [BF16, FP16, FP32]),
    "native_fp8_rowwise": (NativeFp8RowwiseKernel, ROW_SCHEMES, [BF16, FP16]),
    # DeepSeek's FP8 blocks (the fp8 producer, issue 27) load into compressed-tensors' FP8_BLOCK tensors
    "native_fp8_block": (NativeFp8BlockKernel, ["compressed-tensors/FP8_BLOCK", *BLOCK_PRODUCER_SCHEMES], [BF16, FP16]),
    "native_fp8_cpu": (NativeFp8CpuKernel, TENSOR_SCHEMES + ROW_SCHEMES, [BF16, FP16, FP32]),
}
BF16_GEMM = {"native_fp8_rowwise", "native_fp8_block"}
BF16_GEMM_ROUNDING = 3 * 2.0**-8  # a bf16 GEMM output, the bias, then the output rounding
CASES = [(kernel, scheme) for kernel, (_, schemes, _) in KERNELS.items() for scheme in schemes]


def layer(scheme: Scheme, n: int, k: int, seed: int = 0, input_amax: float = 4.0) -> CanonicalWeight:
    return canonicalize(scheme, layer_tensors(scheme, n=n, k=k, seed=seed, input_amax=input_amax))


def fused(scheme: Scheme, n: int, k: int, amaxes: tuple[float, ...]) -> CanonicalWeight:
    """Partitions quantized separately: different weight scales, input scales from ``amaxes``."""
    return concatenate([layer(scheme, n, k, seed=i, input_amax=a) for i, a in enumerate(amaxes)])


def reference_and_bound(
    weight: CanonicalWeight,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    accumulation: float,
    u: float,
    bias_rounded: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference kernel's output (float64) and the elementwise bound of the module docstring
    (``bias_rounded``: the GEMM's own output is rounded before the bias is added)."""
    reference = ReferenceKernel()
    state = reference.prepare(weight, x.device)
    dense = dequantize(weight).to(x.device)
    magnitude = torch.cat(
        [
            values.double().abs()
            @ (dense if scaling is None else dense[scaling.start : scaling.stop]).double().abs().t()
            for scaling, values in reference.quantize_input(state, x)
        ],
        dim=-1,
    )
    expected = reference.apply(state, x, bias).double()
    spread = expected.abs() + (bias.double().abs() if bias is not None and bias_rounded else 0.0)
    return expected, accumulation * magnitude + u * spread


def bound_for(
    kernel: str, weight: CanonicalWeight, x: torch.Tensor, bias: torch.Tensor | None, accumulation: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if kernel in BF16_GEMM:
        return reference_and_bound(weight, x, bias, accumulation, BF16_GEMM_ROUNDING, bias_rounded=True)
    return reference_and_bound(weight, x, bias, accumulation, OUTPUT_ULP[x.dtype])


def assert_within(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, label: str) -> None:
    assert actual.shape == expected.shape, f"{label}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    if actual.numel() == 0:
        return
    error = (actual.double() - expected).abs()
    worst = int(torch.argmax(error - bound))
    assert bool((error <= bound).all()), (
        f"{label}: error {float(error.flatten()[worst]):.3e} exceeds the bound {float(bound.flatten()[worst]):.3e} "
        f"(output {float(expected.flatten()[worst]):.4g})"
    )


# --- block GEMM on a CPU: meta-validated, then emulated --------------------------------------------

_SCALED_MM = functional.scaled_mm


def on_meta(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor of the same shape, strides and dtype."""
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")


def emulated_block_scaled_mm(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_recipe_a: functional.ScalingType,
    scale_b: torch.Tensor,
    scale_recipe_b: functional.ScalingType,
    output_dtype: torch.dtype,
) -> torch.Tensor:
    """torch.nn.functional.scaled_mm for (BlockWise1x128, BlockWise128x128) on a CPU: the exact
    call is first checked by torch's meta function, then computed as torch documents it:
    scale_a[m, j] scales mat_a[m, 128j:128j+128], scale_b[i, j] the 128x128 block
    mat_b[128i:, 128j:] (its rows past K / 128 are alignment padding)."""
    meta = _SCALED_MM(
        on_meta(mat_a),
        on_meta(mat_b),
        on_meta(scale_a),
        scale_recipe_a,
        on_meta(scale_b),
        scale_recipe_b,
        output_dtype=output_dtype,
    )
    assert scale_recipe_a == functional.ScalingType.BlockWise1x128
    assert scale_recipe_b == functional.ScalingType.BlockWise128x128
    k, n = mat_b.shape
    a = mat_a.float() * scale_a.repeat_interleave(128, dim=1)[:, :k]
    blocks = scale_b[: -(-k // 128)].repeat_interleave(128, dim=0)[:k].repeat_interleave(128, dim=1)[:, :n]
    y = (a.double() @ (mat_b.float() * blocks).double()).to(output_dtype)
    assert meta.shape == y.shape and meta.dtype == y.dtype
    return y


@pytest.fixture
def cpu_block_gemm(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(functional, "scaled_mm", emulated_block_scaled_mm)
    yield


# --- activation quantization: the emulation's codes and scales, bit for bit ------------------------


def awkward_input(rows: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Normal values, a zero row, a zero group, values far above the static range (saturating),
    and tiny ones (subnormal codes)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=generator) * 3
    x[1] = 0.0
    x[2, :128] = 0.0
    x[3, :5] = torch.tensor([1e4, -1e4, 1e-6, -3e-7, 2.0**-20])
    x[4] *= 1e-5
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("k", [128, 200, 1000])
def test_activation_codes_and_scales_equal_the_emulation(dtype: torch.dtype, k: int) -> None:
    x = awkward_input(7, k, dtype, seed=k)
    values = x.float()
    static = builtin_scheme("compressed-tensors/FP8").activation
    token = builtin_scheme("compressed-tensors/FP8_DYNAMIC").activation
    group = builtin_scheme("compressed-tensors/FP8_BLOCK").activation
    assert static is not None and token is not None and group is not None
    input_scale = torch.tensor([4.0 / 448.0])

    expected = quantize_activation(x, static, input_scale=input_scale)
    codes = quantize_static(values, input_scale.reshape(()))
    assert torch.equal(codes.view(torch.uint8), expected.codes.view(torch.uint8))
    assert int((codes.float().abs() == 448).sum()) >= 2  # the saturated values

    expected = quantize_activation(x, token)
    codes, scales = quantize_per_token(values)
    assert torch.equal(codes.view(torch.uint8), expected.codes.view(torch.uint8))
    assert torch.equal(scales, expected.scale)
    assert float(scales[1]) == torch.finfo(torch.float32).eps  # the zero row

    expected = quantize_activation(x, group)
    padded = functional.pad(values, (0, -k % 128))
    codes, scales = quantize_per_group(padded)
    assert torch.equal(codes[:, :k].view(torch.uint8), expected.codes.view(torch.uint8))
    assert not bool(codes[:, k:].float().any())  # the padding quantizes to zero codes
    assert torch.equal(scales, expected.scale)


# --- every claimed scheme against the reference, on the CPU ----------------------------------------

SHAPES = [(1, 72, 200), (5, 40, 136), (3, 128, 256), (0, 40, 136)]


@pytest.mark.parametrize(("m", "n", "k"), SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
@pytest.mark.parametrize(("kernel_name", "scheme_name"), CASES, ids=[f"{k}-{s}" for k, s in CASES])
@pytest.mark.usefixtures("cpu_block_gemm")
def test_matches_the_reference_on_cpu(kernel_name: str, scheme_name: str, m: int, n: int, k: int) -> None:
    make, _, dtypes = KERNELS[kernel_name]
    kernel = make()
    weight = layer(scheme_named(scheme_name), n, k, seed=m)
    state = kernel.prepare(weight, CPU)
    generator = torch.Generator().manual_seed(n + k)
    for dtype in dtypes:
        x = (torch.randn(2, m, k, generator=generator) * 2).to(dtype)  # 3-D [B, T, K]
        for bias in (None, torch.randn(n, generator=generator)):
            y = kernel.apply(state, x, bias)
            assert y.shape == (2, m, n) and y.dtype == dtype
            expected, bound = bound_for(kernel_name, weight, x, bias, CPU_ACCUMULATION)
            assert_within(y, expected, bound, f"{kernel_name} {scheme_name} {dtype} bias={bias is not None}")


FUSED_CASES = [c for c in CASES if c[0] != "native_fp8_block"]  # block scales: no per-partition scalars


@pytest.mark.parametrize("amaxes", [(4.0, 9.0, 4.0), (4.0, 4.0, 4.0)], ids=["different", "equal"])
@pytest.mark.parametrize(("kernel_name", "scheme_name"), FUSED_CASES, ids=[f"{k}-{s}" for k, s in FUSED_CASES])
def test_fused_partitions_match_the_reference(kernel_name: str, scheme_name: str, amaxes: tuple[float, ...]) -> None:
    """Three partitions quantized apart (per-partition weight scales; static input scales from
    the amaxes): as exact as three layers, whatever the kernel merges into one GEMM."""
    make, _, dtypes = KERNELS[kernel_name]
    kernel = make()
    weight = fused(scheme_named(scheme_name), 40, 200, amaxes)
    state = kernel.prepare(weight, CPU)
    assert isinstance(state, Fp8State) and weight.partitions == (40, 40, 40)
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(5)) * 3
    bias = torch.randn(120, generator=torch.Generator().manual_seed(6))
    for dtype in dtypes:
        y = kernel.apply(state, x.to(dtype), bias)
        expected, bound = bound_for(kernel_name, weight, x.to(dtype), bias, CPU_ACCUMULATION)
        assert_within(y, expected, bound, f"{kernel_name} {scheme_name} fused {amaxes} {dtype}")


def test_runs_follow_the_scales_each_kernel_must_keep_apart() -> None:
    tensor_static = fused(builtin_scheme("compressed-tensors/FP8"), 40, 200, (4.0, 4.0, 9.0))
    # tensor-wise: each partition's own weight scale needs its own GEMM; two input scales
    state = NativeFp8Kernel().prepare(tensor_static, CPU)
    assert [(r.start, r.stop, r.input_index) for r in state.runs] == [(0, 40, 0), (40, 80, 0), (80, 120, 1)]
    assert len(state.input_scales) == 2
    # row-wise on the CPU: weight scales are per row; only the input scale splits
    state = NativeFp8CpuKernel().prepare(tensor_static, CPU)
    assert [(r.start, r.stop, r.input_index) for r in state.runs] == [(0, 80, 0), (80, 120, 1)]
    shared = concatenate([layer(builtin_scheme("compressed-tensors/FP8"), 40, 200)] * 2)
    assert len(NativeFp8Kernel().prepare(shared, CPU).runs) == 1  # equal scales: one GEMM
    dynamic = fused(builtin_scheme("compressed-tensors/FP8_DYNAMIC"), 40, 200, (4.0, 9.0, 4.0))
    assert len(NativeFp8RowwiseKernel().prepare(dynamic, CPU).runs) == 1


def test_quantizing_the_shared_input_once_with_one_scale_would_be_wrong() -> None:
    """The fused test above can fail: with the first partition's input scale for all three, the
    third partition (amax 9 against 4: saturated inputs) leaves the bound."""
    weight = fused(CHANNEL_STATIC, 40, 200, (4.0, 4.0, 9.0))
    kernel = NativeFp8CpuKernel()
    state = kernel.prepare(weight, CPU)
    wrong = replace(state, runs=tuple(replace(r, input_index=0) for r in state.runs))
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(5)) * 3
    expected, bound = reference_and_bound(weight, x, None, CPU_ACCUMULATION, 0.0)
    assert_within(kernel.apply(state, x, None), expected, bound, "per-scale runs")
    with pytest.raises(AssertionError, match="exceeds the bound"):
        assert_within(kernel.apply(wrong, x, None), expected, bound, "one shared scale")


def test_quant_linear_runs_the_forced_cpu_kernel() -> None:
    scheme = builtin_scheme("compressed-tensors/FP8_DYNAMIC")
    tensors = layer_tensors(scheme, n=72, k=200)
    layer_ = QuantLinear.from_tensors(scheme, tensors, kernel="native_fp8_cpu", activation_dtype="bfloat16")
    assert layer_.kernel.name == "native_fp8_cpu"
    x = torch.randn(2, 3, 200, dtype=BF16)
    expected, bound = reference_and_bound(canonicalize(scheme, tensors), x, None, CPU_ACCUMULATION, 2.0**-7)
    assert_within(layer_(x), expected, bound, "QuantLinear native_fp8_cpu")


def test_e5m2_weights_and_pre_scales_are_refused_when_preparing() -> None:
    weight = layer(builtin_scheme("compressed-tensors/FP8_DYNAMIC"), 32, 128)
    e5m2 = replace(weight, codes=weight.codes.float().to(torch.float8_e5m2))
    for kernel in (NativeFp8Kernel(), NativeFp8RowwiseKernel(), NativeFp8BlockKernel(), NativeFp8CpuKernel()):
        with pytest.raises(UsageError, match=r"multiplies float8_e4m3fn weights; .* stores torch.float8_e5m2"):
            kernel.prepare(e5m2, CPU)
    with pytest.raises(UsageError, match="applies no input pre-scale"):
        NativeFp8CpuKernel().prepare(replace(weight, input_pre_scale=torch.ones(128)), CPU)


# --- the exact CUDA calls, on the meta device -------------------------------------------------------

META_M = [1, 16, 17, 128, 300]
META_LAYERS = [(256, 512), (72, 200), (300, 130), (17, 1000)]
META_CASES = [
    ("native_fp8", "compressed-tensors/FP8"),
    ("native_fp8_rowwise", "compressed-tensors/FP8_DYNAMIC"),
    ("native_fp8_rowwise", CHANNEL_STATIC.name),
    ("native_fp8_block", "compressed-tensors/FP8_BLOCK"),
    ("native_fp8_block", "fp8/FP8_BLOCK_UE8M0"),
]


@pytest.mark.parametrize(("n", "k"), META_LAYERS, ids=[f"{n}x{k}" for n, k in META_LAYERS])
@pytest.mark.parametrize(("kernel_name", "scheme_name"), META_CASES, ids=[f"{k}-{s}" for k, s in META_CASES])
def test_the_cuda_calls_validate_on_the_meta_device(kernel_name: str, scheme_name: str, n: int, k: int) -> None:
    """The whole apply on meta tensors: torch's meta functions check what CUDA checks (operand
    majorness, K and N multiples of 16, scale shapes, dtypes and strides), for several M and
    ragged N, K (edge blocks)."""
    make, _, _ = KERNELS[kernel_name]
    kernel = make()
    scheme = scheme_named(scheme_name)
    # two partitions with different scales (block scales have no per-partition scalars)
    weight = layer(scheme, n, k) if kernel_name == "native_fp8_block" else fused(scheme, n, k, (4.0, 9.0))
    state = kernel.prepare(weight, CPU).to("meta")
    multiple = 128 if kernel_name == "native_fp8_block" else 16
    assert state.padded_k % multiple == 0
    for run in state.runs:
        assert run.weight.dtype == torch.float8_e4m3fn and run.weight.is_contiguous()
        assert run.weight.shape[0] % multiple == 0 and run.weight.shape[1] == state.padded_k
    for m in META_M:
        x = torch.empty(m, k, dtype=BF16, device="meta")
        y = kernel.apply(state, x, torch.empty(weight.n, device="meta"))
        assert y.shape == (m, weight.n) and y.dtype == BF16


def test_the_meta_device_refuses_what_cuda_refuses() -> None:
    """The meta checks have teeth: unpadded K, a row-major weight, a broadcast (stride-0) row
    scale and row-major 1x128 scales are refused, as CUDA refuses them."""
    a = torch.empty(5, 200, dtype=torch.float8_e4m3fn, device="meta")
    b = torch.empty(64, 200, dtype=torch.float8_e4m3fn, device="meta")
    one = torch.empty((), device="meta")
    with pytest.raises(RuntimeError, match="divisible by 16"):
        torch._scaled_mm(a, b.t(), one, one, out_dtype=FP32)
    a = torch.empty(5, 256, dtype=torch.float8_e4m3fn, device="meta")
    b = torch.empty(64, 256, dtype=torch.float8_e4m3fn, device="meta")
    with pytest.raises(RuntimeError, match="col_major"):
        torch._scaled_mm(a, b.t().contiguous(), one, one, out_dtype=FP32)
    scale_b = torch.empty(1, 64, device="meta")
    with pytest.raises(RuntimeError, match="contiguous"):
        torch._scaled_mm(a, b.t(), torch.empty(1, 1, device="meta").expand(5, 1), scale_b, out_dtype=BF16)
    kernel = NativeFp8BlockKernel()
    state = kernel.prepare(layer(builtin_scheme("compressed-tensors/FP8_BLOCK"), 256, 512), CPU).to("meta")
    codes, scale_a, weight, scale_b, _ = kernel.operands(state, torch.empty(16, 512, device="meta"))
    assert scale_a.shape == (16, 4) and scale_a.stride() == (1, 16)  # outer-dim-major
    assert scale_b.shape == (4, 2) and scale_b.stride() == (1, 4)
    recipes = (functional.ScalingType.BlockWise1x128, functional.ScalingType.BlockWise128x128)
    with pytest.raises(RuntimeError, match="1x128 x 128x128 blockwise scaling"):
        functional.scaled_mm(codes, weight, scale_a.contiguous(), recipes[0], scale_b, recipes[1])


@pytest.mark.parametrize(("n", "k"), [(256, 512), (300, 130)])
def test_block_scales_are_padded_to_whole_blocks_and_four_k_blocks(n: int, k: int) -> None:
    weight = layer(builtin_scheme("compressed-tensors/FP8_BLOCK"), n, k)
    state = NativeFp8BlockKernel().prepare(weight, CPU)
    assert state.block_scale is not None
    blocks_n, blocks_k = -(-n // 128), -(-k // 128)
    assert state.block_scale.shape == (blocks_n, -(-blocks_k // 4) * 4) and state.block_scale.is_contiguous()
    assert torch.equal(state.block_scale[:, :blocks_k], weight.scale.float())
    assert state.runs[0].weight.shape == (blocks_n * 128, blocks_k * 128)
    assert torch.equal(state.runs[0].weight[:n, :k].view(torch.uint8), weight.codes.view(torch.uint8))
    assert not bool(state.runs[0].weight[n:].float().any()) and not bool(state.runs[0].weight[:, k:].float().any())


def test_the_block_kernel_refuses_to_load_under_a_torch_built_with_cuda_before_12_9(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.6")
    with pytest.raises(ImportError, match=r"built with CUDA 12.6; .* needs cuBLASLt from CUDA 12.9 or newer"):
        NativeFp8BlockKernel()
    monkeypatch.setattr(torch.version, "cuda", "12.9")
    NativeFp8BlockKernel()


# --- declarations and resolution ----------------------------------------------------------------------

MINE = (NATIVE_FP8, NATIVE_FP8_ROWWISE, NATIVE_FP8_BLOCK, NATIVE_FP8_CPU)
DECLARATIONS: tuple[KernelDeclaration, ...] = (REFERENCE, TRITON, *MINE)
FEATURES = ALL_FEATURES | {"nn.functional.scaled_mm", "nn.functional.ScalingType"}
SQUARE = Problem(4096, 4096)


def facts(name: str, interpreter: bool = True) -> DeviceFacts:
    return fake_device(
        name,
        modules=all_modules(DECLARATIONS),
        environment=(("TRITON_INTERPRET", "1"),) if interpreter else (),
        features=FEATURES,
    )


def test_the_plugin_declares_the_four_kernels_with_loadable_code() -> None:
    assert [d.name for d in qscheme_kernels()] == [d.name for d in MINE]
    for declaration, cls in zip(
        MINE, (NativeFp8Kernel, NativeFp8RowwiseKernel, NativeFp8BlockKernel, NativeFp8CpuKernel), strict=True
    ):
        assert isinstance(load_implementation(declaration), cls)
    local = with_environment(facts("sm90"), torch_features=[f for d in MINE for f in d.torch_features])
    assert {f for d in MINE for f in d.torch_features} <= local.torch_features  # the local torch has them all
    assert NATIVE_FP8_CPU.priority < REFERENCE.priority < TRITON.priority < NATIVE_FP8.priority


# (scheme, device) -> chosen kernel, with the reference and triton kernels declared beside these
EXPECTED = {
    ("compressed-tensors/FP8", "sm89"): "native_fp8",
    ("compressed-tensors/FP8", "sm90"): "native_fp8",
    ("compressed-tensors/FP8", "sm100"): "native_fp8",
    ("compressed-tensors/FP8", "sm120"): "native_fp8",
    ("compressed-tensors/FP8", "cpu"): "triton",
    ("modelopt/FP8", "sm89"): "native_fp8",
    ("modelopt/FP8", "sm120"): "native_fp8",
    ("compressed-tensors/FP8_DYNAMIC", "sm89"): "native_fp8_rowwise",
    ("compressed-tensors/FP8_DYNAMIC", "sm90"): "native_fp8_rowwise",
    ("compressed-tensors/FP8_DYNAMIC", "sm100"): "native_fp8_rowwise",
    ("compressed-tensors/FP8_DYNAMIC", "sm120"): "triton",
    ("compressed-tensors/FP8_DYNAMIC", "cpu"): "triton",
    ("compressed-tensors/FP8_BLOCK", "sm89"): "triton",
    ("compressed-tensors/FP8_BLOCK", "sm90"): "native_fp8_block",
    ("compressed-tensors/FP8_BLOCK", "sm100"): "triton",
    ("compressed-tensors/FP8_BLOCK", "sm120"): "triton",
    ("compressed-tensors/FP8_BLOCK", "cpu"): "triton",
    (CHANNEL_STATIC.name, "sm90"): "native_fp8_rowwise",
    (TENSOR_PER_TOKEN.name, "sm100"): "native_fp8_rowwise",
    ("modelopt/fp8_pb_wo", "sm90"): "triton",
}


@pytest.mark.parametrize(("scheme_name", "device_name"), list(EXPECTED), ids=[f"{s}@{d}" for s, d in EXPECTED])
def test_each_fp8_scheme_gets_the_declared_kernel(scheme_name: str, device_name: str) -> None:
    resolution = resolve(scheme_named(scheme_name), SQUARE, facts(device_name), DECLARATIONS)
    assert resolution.kernel is not None and resolution.kernel.name == EXPECTED[(scheme_name, device_name)]


def reason(scheme_name: str, device_name: str, kernel: str, problem: Problem = SQUARE, **kw: bool) -> str:
    resolution = resolve(scheme_named(scheme_name), problem, facts(device_name, **kw), DECLARATIONS)
    return resolution.candidate(kernel).reason


def test_rejection_reasons_name_the_capability_device_scheme_and_dtype() -> None:
    assert reason("compressed-tensors/FP8_BLOCK", "sm100", "native_fp8_block") == (
        "needs compute capability 9.0; device is 10.0"
    )
    assert reason("compressed-tensors/FP8_BLOCK", "sm89", "native_fp8_block") == (
        "needs compute capability 9.0; device is 8.9"
    )
    assert reason("compressed-tensors/FP8_DYNAMIC", "sm120", "native_fp8_rowwise") == (
        "needs compute capability 8.9 or 9.0-9.9 or 10.0-10.3; device is 12.0"
    )
    assert reason("compressed-tensors/FP8", "sm80", "native_fp8") == (
        "needs compute capability 8.9 or newer; device is 8.0"
    )
    assert reason("compressed-tensors/FP8", "cpu", "native_fp8") == "runs on cuda; device is cpu"
    assert reason("compressed-tensors/FP8_DYNAMIC", "sm90", "native_fp8_cpu") == "runs on cpu; device is cuda"
    assert reason("compressed-tensors/FP8_DYNAMIC", "sm90", "native_fp8") == (
        "takes fp8 weights with fp8 static per tensor activations; scheme has fp8 dynamic per token activations; "
        "takes fp8 weights with tensor scales; scheme has channel scales"
    )
    assert reason("compressed-tensors/FP8", "sm90", "native_fp8_rowwise") == (
        "takes fp8 weights with channel scales; scheme has tensor scales"
    )
    assert reason("compressed-tensors/FP8_BLOCK", "sm90", "native_fp8_rowwise") == (
        "takes fp8 weights with fp8 dynamic per token or fp8 static per tensor activations; "
        "scheme has fp8 dynamic per group of 128 activations"
    )
    assert reason("modelopt/fp8_pb_wo", "sm90", "native_fp8_block") == (
        "takes fp8 weights with fp8 dynamic per group of 128 activations; scheme has none (16-bit) activations"
    )
    fp32 = Problem(4096, 4096, activation_dtype="float32")
    assert reason("compressed-tensors/FP8_DYNAMIC", "sm90", "native_fp8_rowwise", fp32) == (
        "takes bfloat16 or float16 activations; layer has float32"
    )
    assert reason("compressed-tensors/FP8_BLOCK", "sm90", "native_fp8_block", fp32) == (
        "takes bfloat16 or float16 activations; layer has float32"
    )


def test_fp32_layers_and_cpus_without_the_interpreter() -> None:
    fp32 = Problem(4096, 4096, activation_dtype="float32")
    chosen = resolve(builtin_scheme("compressed-tensors/FP8_DYNAMIC"), fp32, facts("sm90"), DECLARATIONS).kernel
    assert chosen is not None and chosen.name == "triton"  # the bf16-output kernels leave fp32 to others
    chosen = resolve(builtin_scheme("compressed-tensors/FP8"), fp32, facts("sm90"), DECLARATIONS).kernel
    assert chosen is not None and chosen.name == "native_fp8"  # float32 GEMM output
    # On a CPU without the Triton interpreter the reference wins; native_fp8_cpu is accepted below it.
    resolution = resolve(
        builtin_scheme("compressed-tensors/FP8"), SQUARE, facts("cpu", interpreter=False), DECLARATIONS
    )
    assert resolution.kernel is not None and resolution.kernel.name == "reference"
    assert resolution.candidate("native_fp8_cpu").reason == "not chosen: reference ranks higher"
    forced = resolve(
        builtin_scheme("compressed-tensors/FP8"),
        Problem(4096, 4096),
        facts("cpu", interpreter=False),
        DECLARATIONS,
        force="native_fp8_cpu",
    )
    assert forced.kernel is not None and forced.kernel.name == "native_fp8_cpu"


def test_fused_layers_with_different_scales_resolve_to_the_native_kernels() -> None:
    problem = Problem(12288, 4096, partitions=3, partition_scales_differ=True)
    for scheme_name, expected in (
        ("compressed-tensors/FP8", "native_fp8"),
        (CHANNEL_STATIC.name, "native_fp8_rowwise"),
    ):
        chosen = resolve(scheme_named(scheme_name), problem, facts("sm90"), DECLARATIONS).kernel
        assert chosen is not None and chosen.name == expected


# --- on a GPU ------------------------------------------------------------------------------------------

GPU_SHAPES = [(1, 72, 200), (16, 512, 1024), (37, 4096, 4096)]
GPU_CASES = [c for c in CASES if c[0] != "native_fp8_cpu"]
GPU_FUSED_CASES = [c for c in FUSED_CASES if c[0] != "native_fp8_cpu"]
DECLARED = {d.name: d for d in MINE}


def require_declared_device(kernel_name: str) -> None:
    capability = torch.cuda.get_device_capability()
    ranges = DECLARED[kernel_name].devices[0].capabilities
    if not any(r.contains(capability) for r in ranges):
        pytest.skip(f"{kernel_name} is declared for {ranges}, not compute capability {capability}")
    if kernel_name == "native_fp8_block":
        try:
            NativeFp8BlockKernel()
        except ImportError as error:
            pytest.skip(str(error))


@pytest.mark.parametrize(("m", "n", "k"), GPU_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in GPU_SHAPES])
@pytest.mark.parametrize(("kernel_name", "scheme_name"), GPU_CASES, ids=[f"{k}-{s}" for k, s in GPU_CASES])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_matches_the_reference(kernel_name: str, scheme_name: str, m: int, n: int, k: int) -> None:
    require_declared_device(kernel_name)
    make, _, dtypes = KERNELS[kernel_name]
    kernel = make()
    device = torch.device("cuda")
    host = layer(scheme_named(scheme_name), n, k, seed=m)
    weight = host.to(device)
    state = kernel.prepare(weight, device)
    generator = torch.Generator().manual_seed(m + n)
    for dtype in dtypes:
        x = (torch.randn(m, k, generator=generator) * 2).to(dtype).to(device)
        bias = torch.randn(n, generator=generator).to(device)
        y = kernel.apply(state, x, bias)
        assert y.shape == (m, n) and y.dtype == dtype and y.device.type == "cuda"
        expected, bound = bound_for(kernel_name, weight, x, bias, CUDA_ACCUMULATION)
        assert_within(y, expected, bound, f"{kernel_name} {scheme_name} {m}x{n}x{k} {dtype} on cuda")


@pytest.mark.parametrize(("kernel_name", "scheme_name"), GPU_FUSED_CASES, ids=[f"{k}-{s}" for k, s in GPU_FUSED_CASES])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_partitions_on_cuda(kernel_name: str, scheme_name: str) -> None:
    require_declared_device(kernel_name)
    make, _, dtypes = KERNELS[kernel_name]
    kernel = make()
    device = torch.device("cuda")
    weight = fused(scheme_named(scheme_name), 40, 200, (4.0, 9.0, 4.0)).to(device)
    state = kernel.prepare(weight, device)
    x = (torch.randn(3, 5, 200, generator=torch.Generator().manual_seed(5)) * 3).to(device)
    for dtype in dtypes:
        y = kernel.apply(state, x.to(dtype), None)
        expected, bound = bound_for(kernel_name, weight, x.to(dtype), None, CUDA_ACCUMULATION)
        assert_within(y, expected, bound, f"{kernel_name} {scheme_name} fused on cuda {dtype}")


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_activation_codes_equal_the_cpu_emulation(dtype: torch.dtype) -> None:
    x = awkward_input(64, 1000, dtype, seed=3)
    values = x.float().cuda()
    token = builtin_scheme("compressed-tensors/FP8_DYNAMIC").activation
    group = builtin_scheme("compressed-tensors/FP8_BLOCK").activation
    assert token is not None and group is not None
    expected = quantize_activation(x, token)
    codes, scales = quantize_per_token(values)
    assert torch.equal(codes.cpu().view(torch.uint8), expected.codes.view(torch.uint8))
    assert torch.equal(scales.cpu(), expected.scale)
    expected = quantize_activation(x, group)
    codes, scales = quantize_per_group(functional.pad(values, (0, 24)))
    assert torch.equal(codes[:, :1000].cpu().view(torch.uint8), expected.codes.view(torch.uint8))
    assert torch.equal(scales.cpu(), expected.scale)
    input_scale = torch.tensor(4.0 / 448.0)
    expected_codes = quantize_static(x.float(), input_scale)
    assert torch.equal(
        quantize_static(values, input_scale.cuda()).cpu().view(torch.uint8), expected_codes.view(torch.uint8)
    )
