"""The native FP4 kernels (qscheme_plugins.native_fp4): NVFP4 x NVFP4 and MXFP4 x MXFP4 through
torch.nn.functional.scaled_mm.

torch runs that GEMM only on compute capability 10.x / 12.x, so on a CPU the kernel's own
activation quantization and operands are multiplied by ``emulated_scaled_mm``, an exact CPU
emulation of the block-scaled GEMM's documented semantics written independently of the kernel
(cuBLAS's scale-tile offset formula, e2m1 decoded by table, element 2j in the low nibble, the
block scales applied per group, the product times global_a * global_b), and compared with the
reference kernel. The real call is validated on the meta device, and runs on an sm100 / sm120
GPU where one is present.

Tolerances: with a float32 output the emulated kernel matches the reference kernel within
``FLOAT32_TOLERANCE`` (1e-5) of the largest output (measured: <= 4.5e-7; the differences are
float32 rounding of the scales' products and the accumulation order). Through ``apply`` in a
16-bit dtype each output is within ``1.5 * eps(dtype) * (|x W^T| + |bias|)`` of the reference's,
plus that float32 term: the GEMM rounds its output and the sum with the bias is rounded again
(half an ulp each), the reference rounds once (half an ulp). Measured: up to 0.66 of that bound.
"""

from __future__ import annotations

import pytest
import torch
from kernel_fakes import builtin_scheme, layer_tensors
from qscheme_plugins.native_fp4 import NATIVE_FP4, NATIVE_MXFP4
from qscheme_plugins.native_fp4_kernel import (
    MXFP4,
    NVFP4,
    Fp4Format,
    NativeFp4Kernel,
    NativeFp4State,
    NativeMxfp4Kernel,
    Operand,
    activation_operand,
    mxfp4_unavailable_reason,
    pack_codes,
    quantize_input,
    round_up,
    scaled_mm_arguments,
    swizzle_block_scales,
    weight_operand,
)
from qscheme_plugins.reference import REFERENCE
from qscheme_plugins.reference_kernel import ReferenceKernel
from qscheme_plugins.triton_declaration import TRITON
from torch.nn import functional

from qscheme.canonical import CanonicalWeight, canonicalize
from qscheme.checkpoint.fuse import concatenate
from qscheme.emulation import apply_pre_scale, quantize_activation
from qscheme.errors import QuantizeError, UsageError
from qscheme.formats import pack_fp4_k
from qscheme.kernels.devices import simulated_device
from qscheme.kernels.problem import Problem
from qscheme.kernels.registry import complete_facts
from qscheme.kernels.resolver import Resolution, resolve

CPU = torch.device("cpu")
NVFP4_SCHEMES = ["compressed-tensors/NVFP4", "modelopt/NVFP4", "modelopt/NVFP4_AWQ"]
MXFP4_SCHEMES = ["compressed-tensors/MXFP4", "modelopt/mxfp4"]
FLOAT32_TOLERANCE = 1e-5
# (N, K): aligned, and ragged (N not a multiple of 128, K not of 64 / 128; the schemes need K % 16 / 32)
SHAPES = {"nvfp4": [(64, 256), (40, 80)], "mxfp4": [(64, 256), (40, 96)]}


def family(scheme_name: str) -> str:
    return "mxfp4" if "mxfp4" in scheme_name.lower() else "nvfp4"


def layer(scheme_name: str, n: int, k: int, seed: int = 0, input_amax: float = 4.0) -> CanonicalWeight:
    scheme = builtin_scheme(scheme_name)
    return canonicalize(scheme, layer_tensors(scheme, n=n, k=k, seed=seed, input_amax=input_amax))


# --- an exact CPU emulation of the block-scaled GEMM, independent of the kernel's code ---------------

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def decode_fp4x2(packed: torch.Tensor) -> torch.Tensor:
    """float4_e2m1fn_x2 [rows, K/2] -> float64 [rows, K]: element 2j in the low nibble, bit 3 the sign."""
    data = packed.contiguous().view(torch.uint8).to(torch.int64)
    nibbles = torch.stack((data & 0xF, data >> 4), dim=-1).flatten(-2)
    magnitude = E2M1_VALUES[nibbles & 0x7]
    return torch.where(nibbles >= 8, -magnitude, magnitude)


def scale_offsets(rows: int, columns: int) -> torch.Tensor:
    """cuBLAS's 1D block-scaling layout: where scale (r, c) lives in the flat swizzled tensor."""
    column_tiles = -(-columns // 4)
    r = torch.arange(rows)[:, None]
    c = torch.arange(columns)[None, :]
    outer, inner = r % 128, c % 4
    return 512 * ((r // 128) * column_tiles + c // 4) + (outer % 32) * 16 + (outer // 32) * 4 + inner


def unswizzle(flat: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """float64 [rows, columns] scale values read from a swizzled e4m3 or e8m0 tensor."""
    data = flat.contiguous().view(torch.uint8)[scale_offsets(rows, columns)]
    if flat.dtype == torch.float8_e4m3fn:
        return data.view(torch.float8_e4m3fn).to(torch.float64)
    assert flat.dtype == torch.float8_e8m0fnu
    return torch.exp2(data.to(torch.float64) - 127)


def _as_list(value: object) -> list:  # type: ignore[type-arg]
    return list(value) if isinstance(value, list | tuple) else [value]


def emulated_scaled_mm(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    scale_a: object,
    scale_recipe_a: object,
    scale_b: object,
    scale_recipe_b: object,
    swizzle_a: object = None,
    swizzle_b: object = None,
    bias: torch.Tensor | None = None,
    output_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """torch.nn.functional.scaled_mm for FP4 operands, in float64, then rounded to ``output_dtype``:
    ``(decode(a) * block_scale_a) @ (decode(b) * block_scale_b)^T * global_a * global_b``."""
    scaling, swizzle = functional.ScalingType, functional.SwizzleType
    recipe_a, recipe_b = _as_list(scale_recipe_a), _as_list(scale_recipe_b)
    scales_a, scales_b = _as_list(scale_a), _as_list(scale_b)
    assert mat_a.dtype == mat_b.dtype == torch.float4_e2m1fn_x2
    assert recipe_a == recipe_b and _as_list(swizzle_a)[0] == _as_list(swizzle_b)[0] == swizzle.SWIZZLE_32_4_4
    group = {scaling.BlockWise1x16: 16, scaling.BlockWise1x32: 32}[recipe_a[0]]
    a, b = decode_fp4x2(mat_a), decode_fp4x2(mat_b.t())  # the weight arrives transposed
    k = a.shape[1]
    assert b.shape[1] == k and k % group == 0
    a = a * unswizzle(scales_a[0], a.shape[0], k // group).repeat_interleave(group, dim=1)
    b = b * unswizzle(scales_b[0], b.shape[0], k // group).repeat_interleave(group, dim=1)
    out = a @ b.t()
    if recipe_a[1:] == [scaling.TensorWise]:
        alpha = scales_a[1].to(torch.float32) * scales_b[1].to(torch.float32)  # torch: a float32 product
        out = out * alpha.to(torch.float64)
    if bias is not None:
        out = out + bias.to(torch.float64)
    return out.to(output_dtype)


def emulated_kernel(mxfp4: bool = False) -> NativeFp4Kernel:
    return (NativeMxfp4Kernel if mxfp4 else NativeFp4Kernel)(scaled_mm=emulated_scaled_mm)


def reference_output(weight: CanonicalWeight, x: torch.Tensor) -> torch.Tensor:
    """The reference kernel's float32 x @ W^T (input pre-scaled and quantized as the scheme says)."""
    kernel = ReferenceKernel()
    return kernel.apply(kernel.prepare(weight, CPU), x.float(), None)


def assert_float32_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = float(expected.abs().max())
    error = float((actual.double() - expected.double()).abs().max())
    assert error <= FLOAT32_TOLERANCE * scale, f"max error {error:.3e}, output scale {scale:.3e}"


# --- (b) operands ----------------------------------------------------------------------------------


def test_swizzle_puts_each_scale_at_the_documented_offset_and_pads_with_zeros() -> None:
    rows, columns = 300, 7  # three row tiles (the last partial), two column tiles (the last partial)
    bits = torch.randint(1, 256, (rows, columns), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    flat = swizzle_block_scales(bits)
    assert flat.shape == (round_up(rows, 128) * round_up(columns, 4),) == (384 * 8,)
    offsets = scale_offsets(rows, columns)
    assert torch.equal(flat[offsets], bits)
    padding = torch.ones_like(flat, dtype=torch.bool)
    padding[offsets.reshape(-1)] = False
    assert int(padding.sum()) == 384 * 8 - rows * columns and not bool(flat[padding].any())
    # one hand-checked element: row 161 (tile 1, outer 33), column 5 (tile 1, inner 1)
    assert int(flat[512 * (1 * 2 + 1) + (33 % 32) * 16 + (33 // 32) * 4 + 1]) == int(bits[161, 5])


def test_codes_are_packed_two_per_byte_with_element_2j_in_the_low_nibble() -> None:
    codes = torch.tensor([[0x1, 0x2, 0x3, 0xC, 0xF, 0x8], [0x7, 0x0, 0x9, 0x6, 0x5, 0x4]], dtype=torch.uint8)
    packed = pack_codes(codes, 64)
    assert packed.dtype == torch.float4_e2m1fn_x2 and packed.shape == (2, 32) and packed.is_contiguous()
    data = packed.view(torch.uint8)
    assert data[0, :3].tolist() == [0x21, 0xC3, 0x8F] and data[1, :3].tolist() == [0x07, 0x69, 0x45]
    assert not bool(data[:, 3:].any())  # K padded with zero codes
    assert torch.equal(data[:, :3], pack_fp4_k(codes))  # the canonical weight order
    # and the emulation reads it back: 0x1 -> 0.5, 0x2 -> 1.0, 0xC -> -2.0, 0x8 -> -0.0
    assert decode_fp4x2(packed)[0, :6].tolist() == [0.5, 1.0, 1.5, -2.0, -6.0, -0.0]


@pytest.mark.parametrize("m", [1, 17, 300])
@pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=["nvfp4", "mxfp4"])
def test_operands_pad_k_to_whole_scale_tiles_and_scales_to_128_rows(m: int, fmt: Fp4Format) -> None:
    n, k = 40, 96  # ragged: N not a multiple of 16 or 128, K not of 4 scale groups (64 / 128)
    k_padded = round_up(k, 4 * fmt.group_size)
    assert k_padded == 128
    groups = -(-k // fmt.group_size)
    codes = torch.randint(0, 16, (m, k), dtype=torch.uint8)
    scale = torch.full((m, groups), 0x38, dtype=torch.uint8)
    if fmt is NVFP4:
        scale = scale.view(torch.float8_e4m3fn)
    glob = torch.tensor([0.5]) if fmt is NVFP4 else None
    a = activation_operand(codes, scale, glob, fmt, k_padded)
    assert a.codes.shape == (m, k_padded // 2) and a.codes.stride() == (k_padded // 2, 1)  # rows not padded
    assert a.block_scale.dtype == fmt.scale_dtype
    assert a.block_scale.numel() == round_up(m, 128) * round_up(k_padded // fmt.group_size, 4)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    w = weight_operand(packed, torch.full((n, groups), 0x38, dtype=torch.uint8), glob, fmt, k_padded)
    assert w.codes.shape == (128, k_padded // 2)  # rows padded to a whole scale tile
    assert torch.equal(w.codes.view(torch.uint8)[:n, : k // 2], packed)
    assert not bool(w.codes.view(torch.uint8)[n:].any()) and not bool(w.codes.view(torch.uint8)[:, k // 2 :].any())
    assert w.block_scale.numel() == 128 * round_up(k_padded // fmt.group_size, 4)
    arguments = scaled_mm_arguments(a, w, fmt, torch.bfloat16)
    assert arguments["mat_b"].shape == (k_padded // 2, 128) and arguments["mat_b"].stride() == (1, k_padded // 2)


# --- (a) + (b) + the emulated GEMM against the reference kernel -----------------------------------------


@pytest.mark.parametrize("scheme_name", NVFP4_SCHEMES + MXFP4_SCHEMES)
def test_emulated_gemm_matches_the_reference_to_float32_rounding(scheme_name: str) -> None:
    kernel = emulated_kernel(family(scheme_name) == "mxfp4")
    generator = torch.Generator().manual_seed(11)
    for n, k in SHAPES[family(scheme_name)]:
        weight = layer(scheme_name, n, k)
        state = kernel.prepare(weight, CPU)
        assert state.k_padded % (4 * state.format.group_size) == 0 and len(state.segments) == 1
        for m in (1, 17, 300):
            x = torch.randn(m, k, generator=generator) * 2
            x[0, :16] = 0.0  # an all-zero group
            actual = kernel.matmul(state, x, torch.float32)
            assert actual.shape == (m, n) and actual.dtype == torch.float32
            assert_float32_close(actual, reference_output(weight, x))


def test_the_activation_quantization_is_the_emulations_bit_for_bit() -> None:
    weight = layer("compressed-tensors/NVFP4", 32, 128, input_amax=5.37)  # a divisor that rounds
    state = NativeFp4Kernel().prepare(weight, CPU)
    (scaling,) = state.inputs
    assert scaling.divisor is not None and torch.equal(scaling.divisor, weight.input_global_scale_divisor)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2)) * 3
    codes, scale = quantize_input(x, state.activation, scaling)
    expected = quantize_activation(x, state.activation, input_global_scale_divisor=weight.input_global_scale_divisor)
    assert torch.equal(codes, expected.codes) and torch.equal(scale, expected.scale.view(torch.uint8))


PRE_PASS_CASES = [("compressed-tensors/NVFP4", 5.37), ("modelopt/NVFP4_AWQ", 3.1), ("compressed-tensors/MXFP4", 4.0)]


@pytest.mark.parametrize(("scheme_name", "amax"), PRE_PASS_CASES, ids=[c[0] for c in PRE_PASS_CASES])
def test_the_triton_pre_pass_gives_the_same_codes_and_scales(scheme_name: str, amax: float) -> None:
    from qscheme.triton.linear import interpreted

    if not interpreted():
        pytest.skip("runs the Triton pre-pass in the interpreter (TRITON_INTERPRET=1); the GPU tests cover CUDA")
    weight = layer(scheme_name, 32, 192, input_amax=amax)
    state = NativeFp4Kernel().prepare(weight, CPU)
    assert state.triton_spec is not None
    x = torch.randn(3, 192, generator=torch.Generator().manual_seed(5)) * 2
    x[1, :32] = 0.0
    (scaling,) = state.inputs
    emulated = quantize_input(x, state.activation, scaling, state.pre_scale)
    pre_pass = quantize_input(x, state.activation, scaling, state.pre_scale, state.triton_spec)
    assert torch.equal(pre_pass[0], emulated[0]) and torch.equal(pre_pass[1], emulated[1])
    if state.pre_scale is not None:  # the AWQ pre-scale is applied first, as the reference does
        values = apply_pre_scale(x, state.pre_scale)
        expected = quantize_activation(values, state.activation, input_global_scale=scaling.global_scale)
        assert torch.equal(emulated[0], expected.codes)


def _bounds(weight: CanonicalWeight, x: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    exact = reference_output(weight, x.reshape(-1, weight.k)).reshape(*x.shape[:-1], weight.n)
    eps = torch.finfo(dtype).eps
    return 1.5 * eps * (exact.abs() + bias.abs()) + FLOAT32_TOLERANCE * float(exact.abs().max())


CASES = [(name, torch.bfloat16) for name in NVFP4_SCHEMES + MXFP4_SCHEMES] + [
    (name, torch.float16) for name in NVFP4_SCHEMES
]


@pytest.mark.parametrize(("scheme_name", "dtype"), CASES, ids=[f"{n}-{str(d)[6:]}" for n, d in CASES])
def test_apply_with_bias_and_3d_input_matches_the_reference(scheme_name: str, dtype: torch.dtype) -> None:
    kernel = emulated_kernel(family(scheme_name) == "mxfp4")
    n, k = SHAPES[family(scheme_name)][1]
    weight = layer(scheme_name, n, k, seed=4)
    state = kernel.prepare(weight, CPU)
    assert (state.pre_scale is not None) == (scheme_name == "modelopt/NVFP4_AWQ")  # the AWQ pre-scale is applied
    generator = torch.Generator().manual_seed(6)
    x = (torch.randn(2, 3, k, generator=generator) * 2).to(dtype)
    bias = torch.randn(n, generator=generator)
    y = kernel.apply(state, x, bias)
    assert y.shape == (2, 3, n) and y.dtype == dtype
    reference = ReferenceKernel()
    expected = reference.apply(reference.prepare(weight, CPU), x, bias)
    error = (y.double() - expected.double()).abs()
    bound = _bounds(weight, x, bias, dtype)
    assert bool((error <= bound).all()), f"max error {float(error.max()):.3e} (bound there {float(bound.max()):.3e})"
    one = kernel.apply(state, x[:1, :1], None)  # M = 1, no bias
    assert one.shape == (1, 1, n)
    assert bool(
        ((one.double() - reference.apply(reference.prepare(weight, CPU), x[:1, :1], None)).abs() <= bound[:1, :1]).all()
    )
    empty = kernel.apply(state, x[:, :0], bias)
    assert empty.shape == (2, 0, n) and empty.dtype == dtype


def test_fused_partitions_run_one_gemm_per_run_of_equal_global_scales() -> None:
    kernel = emulated_kernel()
    scheme = "modelopt/NVFP4"
    # q, k, v: k and v share their input scale (amax 4.0), q has its own; every weight scale differs
    members = [layer(scheme, n, 128, seed=s, input_amax=a) for n, s, a in [(48, 0, 9.0), (16, 1, 4.0), (16, 2, 4.0)]]
    assert len({float(m.global_scale) for m in members}) == 3  # type: ignore[arg-type]
    fused = concatenate(members)
    state = kernel.prepare(fused, CPU)
    assert [(s.start, s.stop, s.input_index) for s in state.segments] == [(0, 48, 0), (48, 64, 1), (64, 80, 1)]
    assert len(state.inputs) == 2  # the input is quantized twice, not three times, and never with a shared max
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(8)) * 3
    actual = kernel.matmul(state, x, torch.float32)
    assert_float32_close(actual, reference_output(fused, x))
    separate = torch.cat([kernel.matmul(kernel.prepare(m, CPU), x, torch.float32) for m in members], dim=-1)
    assert torch.equal(actual, separate)
    # equal scales: one GEMM over the whole fused layer
    shared = kernel.prepare(concatenate([members[1], members[1], members[1]]), CPU)
    assert [(s.start, s.stop) for s in shared.segments] == [(0, 48)] and len(shared.inputs) == 1
    # ... and MXFP4 has no global scales: always one GEMM
    mx = concatenate([layer("compressed-tensors/MXFP4", 32, 128, seed=s) for s in (0, 1)])
    mx_state = emulated_kernel(mxfp4=True).prepare(mx, CPU)
    assert len(mx_state.segments) == 1
    assert_float32_close(emulated_kernel(mxfp4=True).matmul(mx_state, x, torch.float32), reference_output(mx, x))


def test_compressed_tensors_fused_partitions_with_different_divisors_are_exact() -> None:
    kernel = emulated_kernel()
    members = [layer("compressed-tensors/NVFP4", 32, 64, seed=s, input_amax=a) for s, a in [(0, 5.37), (1, 2.2)]]
    fused = concatenate(members)
    state = kernel.prepare(fused, CPU)
    assert len(state.segments) == 2 and all(s.divisor is not None for s in state.inputs)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(9)) * 3
    assert_float32_close(kernel.matmul(state, x, torch.float32), reference_output(fused, x))


def test_misuse_is_refused_with_the_reason() -> None:
    weight = layer("modelopt/NVFP4", 32, 64)
    kernel = emulated_kernel()
    state = kernel.prepare(weight, CPU)
    with pytest.raises(UsageError, match=r"takes bfloat16 or float16 inputs, not torch\.float32"):
        kernel.apply(state, torch.randn(2, 64), None)
    with pytest.raises(UsageError, match="the layer takes K=64"):
        kernel.apply(state, torch.randn(2, 48, dtype=torch.bfloat16), None)
    from dataclasses import replace

    with pytest.raises(QuantizeError, match="need the calibrated input global scale"):
        kernel.prepare(replace(weight, input_global_scale=None, input_global_scale_divisor=None), CPU)
    with pytest.raises(QuantizeError, match="takes e2m1 weights and activations"):
        kernel.prepare(layer("compressed-tensors/NVFP4A16", 32, 64), CPU)


# --- the real torch.nn.functional.scaled_mm call, validated on the meta device ------------------------


def meta_operands(state: NativeFp4State, m: int) -> tuple[Operand, Operand]:
    """The activation operand ``apply`` builds for M rows, and the first weight operand, on meta."""
    meta = torch.device("meta")
    fmt = state.format
    codes = torch.empty((m, state.k), dtype=torch.uint8, device=meta)
    scale = torch.empty((m, -(-state.k // fmt.group_size)), dtype=torch.uint8, device=meta)
    glob = torch.empty(1, dtype=torch.float32, device=meta) if fmt is NVFP4 else None
    a = activation_operand(codes, scale, glob, fmt, state.k_padded)
    return a, state.to(meta).segments[0].weight


META_SHAPES = [(m, 256, 512) for m in (1, 16, 17, 128, 300)] + [(17, 40, 80), (1, 200, 208)]


@pytest.mark.parametrize(("m", "n", "k"), META_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in META_SHAPES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_nvfp4_call_validates_on_the_meta_device(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    state = NativeFp4Kernel().prepare(layer("modelopt/NVFP4", n, k), CPU)
    a, w = meta_operands(state, m)
    y = functional.scaled_mm(**scaled_mm_arguments(a, w, NVFP4, dtype))
    assert y.device.type == "meta" and y.shape == (m, round_up(n, 128)) and y.dtype == dtype


def test_the_meta_device_refuses_a_wrong_sized_scale() -> None:
    state = NativeFp4Kernel().prepare(layer("modelopt/NVFP4", 256, 512), CPU)
    a, w = meta_operands(state, 17)
    short = Operand(a.codes, a.block_scale[:-16], a.global_scale)
    with pytest.raises(RuntimeError, match=r"scale_a must have 4096 \(got: 4080\)"):
        functional.scaled_mm(**scaled_mm_arguments(short, w, NVFP4, torch.bfloat16))


def test_torch_2_13s_meta_check_counts_mxfp4_scales_over_packed_k_unlike_its_cuda_kernel() -> None:
    """The CUDA kernel (_scaled_mxfp4_mxfp4 in ScaledBlas.cpp) wants round_up(M, 128) *
    round_up(K / 32, 4) e8m0 scales; the meta registration counts columns over the packed K / 2.
    The operands follow the CUDA kernel, so the meta device refuses them with half the count."""
    state = NativeFp4Kernel().prepare(layer("compressed-tensors/MXFP4", 256, 512), CPU)
    a, w = meta_operands(state, 17)
    assert a.block_scale.numel() == 128 * round_up(512 // 32, 4) == 2048
    assert w.block_scale.numel() == 256 * round_up(512 // 32, 4) == 4096
    with pytest.raises(RuntimeError, match=r"scale_a must have 1024 \(got: 2048\) and scale_b must have 2048"):
        functional.scaled_mm(**scaled_mm_arguments(a, w, MXFP4, torch.bfloat16))


# --- declarations and resolution -------------------------------------------------------------------------

DECLARATIONS = (REFERENCE, TRITON, NATIVE_FP4, NATIVE_MXFP4)
SQUARE = Problem(4096, 4096, "bfloat16")


def resolved(scheme_name: str, device: str, problem: Problem = SQUARE, torch_build: str | None = None) -> Resolution:
    facts = simulated_device(device) if torch_build is None else simulated_device(device, torch_build=torch_build)
    return resolve(builtin_scheme(scheme_name), problem, complete_facts(facts, DECLARATIONS), DECLARATIONS)


@pytest.mark.parametrize("scheme_name", NVFP4_SCHEMES)
def test_blackwell_picks_native_fp4_for_nvfp4_and_hopper_rejects_it(scheme_name: str) -> None:
    for device in ("sm100", "sm103", "sm120"):
        resolution = resolved(scheme_name, device)
        assert resolution.kernel is not None and resolution.kernel.name == "native_fp4", resolution.trace
    hopper = resolved(scheme_name, "sm90")
    assert hopper.kernel is not None and hopper.kernel.name == "triton"
    native = hopper.candidate("native_fp4")
    assert (native.stage, native.reason) == ("device", "needs compute capability 10.0-10.3 or 12.0-12.1; device is 9.0")


def test_a_cpu_only_torch_build_rejects_native_fp4() -> None:
    resolution = resolved("compressed-tensors/NVFP4", "sm100", torch_build="cpu")
    native = resolution.candidate("native_fp4")
    assert native.stage == "device" and "here is a CPU-only build: it has no cuda kernels" in native.reason
    assert resolution.kernel is None or resolution.kernel.name != "native_fp4"


def test_native_fp4_takes_16_bit_inputs_fused_scales_and_any_shape() -> None:
    fp32 = resolved("modelopt/NVFP4", "sm100", Problem(4096, 4096, "float32")).candidate("native_fp4")
    assert (fp32.stage, fp32.reason) == ("problem", "takes bfloat16 or float16 activations; layer has float32")
    fp16 = resolved("modelopt/NVFP4", "sm120", Problem(4096, 4096, "float16"))
    assert fp16.kernel is not None and fp16.kernel.name == "native_fp4"
    fused = Problem(6144, 4096, "bfloat16", partitions=3, partition_scales_differ=True, input_pre_scale=True)
    assert resolved("modelopt/NVFP4_AWQ", "sm100", fused).candidate("native_fp4").chosen
    ragged = resolved("compressed-tensors/NVFP4", "sm100", Problem(1000, 1008, "bfloat16"))  # padded, not refused
    assert ragged.candidate("native_fp4").chosen


def test_mxfp4_runs_natively_on_datacenter_blackwell_only_and_in_bf16() -> None:
    for scheme_name in MXFP4_SCHEMES:
        b200 = resolved(scheme_name, "sm100")
        assert b200.kernel is not None and b200.kernel.name == "native_mxfp4"
        assert b200.candidate("native_fp4").reason == "implements nvfp4 weights; scheme has mxfp4 weights"
        rtx = resolved(scheme_name, "sm120")
        assert rtx.kernel is not None and rtx.kernel.name == "triton"
        assert rtx.candidate("native_mxfp4").reason == "needs compute capability 10.0-10.3; device is 12.0"
    fp16 = resolved("compressed-tensors/MXFP4", "sm100", Problem(4096, 4096, "float16")).candidate("native_mxfp4")
    assert fp16.reason == "takes bfloat16 activations; layer has float16"


def test_weight_only_fp4_schemes_are_not_claimed() -> None:
    for scheme_name in ("compressed-tensors/NVFP4A16", "compressed-tensors/MXFP4A16", "modelopt/W4A16_NVFP4"):
        resolution = resolved(scheme_name, "sm100")
        for name in ("native_fp4", "native_mxfp4"):
            assert resolution.candidate(name).stage == "scheme"


def test_the_declarations_name_features_the_local_torch_has() -> None:
    for declaration in (NATIVE_FP4, NATIVE_MXFP4):
        facts = complete_facts(simulated_device("sm100"), (declaration,))
        assert set(declaration.torch_features) <= facts.torch_features
        assert "nn.functional.scaled_mm" in declaration.torch_features


def test_the_mxfp4_implementation_needs_a_torch_built_with_mslk() -> None:
    with_mslk = "Build settings: ..., USE_CUDA=ON, USE_MSLK=ON, ..."
    assert mxfp4_unavailable_reason("12.8", with_mslk, "linux") is None
    reason = mxfp4_unavailable_reason("12.8", "Build settings: USE_CUDA=ON", "linux")
    assert reason is not None and "built without MSLK (USE_MSLK)" in reason
    assert mxfp4_unavailable_reason("12.8", with_mslk, "win32") == "torch's MXFP4 GEMM is not built on Windows"
    assert mxfp4_unavailable_reason(None, "", "linux") is None  # a CPU-only build: the resolver says so
    NativeMxfp4Kernel()  # this machine's torch (a CPU build) loads it


# --- the real GEMM on sm100 / sm120 -----------------------------------------------------------------------


def _capability() -> tuple[int, int] | None:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


CAPABILITY = _capability()
ON_BLACKWELL = CAPABILITY is not None and (CAPABILITY[0] == 10 or CAPABILITY[:2] in ((12, 0), (12, 1)))
FOUND = "no CUDA GPU" if CAPABILITY is None else f"compute capability {CAPABILITY[0]}.{CAPABILITY[1]}"
GPU_SHAPES = [(1, 256, 512), (17, 200, 208), (300, 1024, 2048)]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_BLACKWELL, reason=f"needs compute capability 10.0-10.3 or 12.0-12.1 ({FOUND} here)")
@pytest.mark.parametrize(("m", "n", "k"), GPU_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in GPU_SHAPES])
@pytest.mark.parametrize("scheme_name", NVFP4_SCHEMES)
def test_nvfp4_on_blackwell_matches_the_reference_and_the_emulation(scheme_name: str, m: int, n: int, k: int) -> None:
    _run_on_gpu(scheme_name, m, n, k, NativeFp4Kernel())


def _mxfp4_gpu_reason() -> str | None:
    if CAPABILITY is None or CAPABILITY[0] != 10:
        return f"torch runs MXFP4 x MXFP4 on compute capability 10.x only ({FOUND} here)"
    import sys

    return mxfp4_unavailable_reason(torch.version.cuda, torch.__config__.show(), sys.platform)


@pytest.mark.gpu
@pytest.mark.skipif(_mxfp4_gpu_reason() is not None, reason=str(_mxfp4_gpu_reason()))
@pytest.mark.parametrize(("m", "n", "k"), GPU_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in GPU_SHAPES])
@pytest.mark.parametrize("scheme_name", MXFP4_SCHEMES)
def test_mxfp4_on_b200_matches_the_reference_and_the_emulation(scheme_name: str, m: int, n: int, k: int) -> None:
    _run_on_gpu(scheme_name, m, n, k, NativeMxfp4Kernel())


def _run_on_gpu(scheme_name: str, m: int, n: int, k: int, kernel: NativeFp4Kernel) -> None:
    device = torch.device("cuda")
    weight = layer(scheme_name, n, k, seed=m)
    generator = torch.Generator().manual_seed(m + n + k)
    x = (torch.randn(m, k, generator=generator) * 2).to(torch.bfloat16)
    bias = torch.randn(n, generator=generator)
    state = kernel.prepare(weight, device)
    y = kernel.apply(state, x.to(device), bias.to(device)).cpu()
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    error = (y.double() - ReferenceKernel().apply(ReferenceKernel().prepare(weight, CPU), x, bias).double()).abs()
    assert bool((error <= _bounds(weight, x, bias, torch.bfloat16)).all()), f"max error {float(error.max()):.3e}"
    # the hardware's GEMM against the emulation, on the very operands: layout and semantics
    (scaling,) = state.inputs[:1]
    a = kernel.quantized_operand(state, x.to(device), scaling)
    arguments = scaled_mm_arguments(a, state.segments[0].weight, state.format, torch.bfloat16)
    real = functional.scaled_mm(**arguments).float().cpu()
    on_cpu = {name: _to_cpu(value) for name, value in arguments.items()}
    emulated = emulated_scaled_mm(**on_cpu).float()
    tolerance = torch.finfo(torch.bfloat16).eps * emulated.abs() + 1e-5 * float(emulated.abs().max())
    assert bool(((real - emulated).abs() <= tolerance).all())


def _to_cpu(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value
