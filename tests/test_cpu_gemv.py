"""The ``cpu_gemv`` kernel (qscheme._cpu_gemv, C++) against the reference kernel.

Every built-in scheme its declaration covers, quantized from a random layer (``layer_tensors``:
qscheme's own quantizer writes the checkpoint tensors, which are canonicalized as a loaded
checkpoint is), runs on every loop this CPU has (AVX-512, AVX2) and on the portable one, with
ragged N and K, M = 0, 1, a 3-D input and more than 8 rows, a bias, bfloat16, float16 and float32
inputs, each on the AVX-512 loops with and without the AMX tile path. The bound is the
declaration's: per output, (2K + 8) * 2**-24 * sum_k |x_k w_k| (the input as the reference
multiplies it: pre-scaled and quantized), plus for 16-bit outputs one rounding of each side's
output (one unit in the last place: 2**-7 of the larger for bfloat16).

Also: fused layers whose partitions have different global scales equal the separate layers' outputs
bit for bit; the row dequantization is the reference's float32 weight bit for bit; the prepared
state keeps the canonical tensors (no copy); the resolver's choices on a CPU; the ISA switch; the
ops' fake implementations (torch.library.opcheck); typed refusals.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
import pickle
from collections.abc import Iterator

import pytest
import torch
from cpu_features import cpu_flags
from kernel_fakes import all_modules, builtin_scheme, builtin_schemes, fake_device, layer_tensors
from qscheme_plugins.cpu_gemv import CPU_GEMV, NativeLoops
from qscheme_plugins.cpu_gemv_kernel import CpuGemvKernel, scaled_codes
from qscheme_plugins.reference_kernel import ReferenceKernel

from qscheme import cpu_gemv
from qscheme.canonical import CanonicalWeight, canonicalize, dequantize, dequantize_rows
from qscheme.checkpoint.fuse import concatenate
from qscheme.emulation import apply_pre_scale
from qscheme.errors import QuantizeError, UsageError
from qscheme.kernels import registry
from qscheme.kernels.problem import Problem
from qscheme.kernels.resolver import SchemeFeatures, check_scheme, resolve
from qscheme.modules import QuantLinear

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason="qscheme._cpu_gemv is not built")

CPU = torch.device("cpu")
SCHEME_NAMES = sorted(
    scheme.name for scheme in builtin_schemes() if check_scheme(CPU_GEMV, SchemeFeatures.of(scheme))[0]
)
# Written out: the schemes issue 29 names must be among those the declaration covers.
EXPECTED = {
    "compressed-tensors/NVFP4A16",
    "compressed-tensors/NVFP4",
    "compressed-tensors/MXFP4A16",
    "compressed-tensors/MXFP4",
    "compressed-tensors/FP8",
    "compressed-tensors/FP8_DYNAMIC",
    "compressed-tensors/FP8_BLOCK",
    "compressed-tensors/W8A16_G32",
    "compressed-tensors/W8A8",
    "compressed-tensors/W4A16",
    "compressed-tensors/W4A16_ASYM",
    "modelopt/NVFP4",
    "modelopt/W4A16_NVFP4",
    "modelopt/FP8",
    "modelopt/fp8_pb_wo",
    "gptq/W8A16",
    "gptq/W8A16_CHANNEL",
    "mxfp4/MXFP4",
    "fp8/FP8_BLOCK",
}
# "amx": the AVX-512 loops with the tile path (cpu_gemv_amx.cpp) taking every M ("all"; by default
# it starts at M = 4), where this CPU has it; "vnni": the AVX-512 loops with the VNNI integer loop
# for one to four bfloat16 rows of 4-bit codes (cpu_gemv_int16.cpp), where this CPU has it, the
# AVX512-BF16 loop off; "bf16dot": the AVX-512 loops with the AVX512-BF16 loop for the layers and rows
# it takes (cpu_gemv_bf16dot.cpp), the VNNI loop for the others; "avx512" with all three off
# (QSCHEME_CPU_GEMV_AMX=0, QSCHEME_CPU_GEMV_INT16=0, QSCHEME_CPU_GEMV_BF16DOT=0), so that each runs every case
ISAS = ("scalar", "avx2", "avx512", "vnni", "bf16dot", "amx")
AMX_VARIABLE = "QSCHEME_CPU_GEMV_AMX"
INT16_VARIABLE = "QSCHEME_CPU_GEMV_INT16"
BF16DOT_VARIABLE = "QSCHEME_CPU_GEMV_BF16DOT"
DOT_LOOPS = ("vnni", "bf16dot")
# what the tile path needs (cpuid, as /proc/cpuinfo names it; Linux grants the tile state)
AMX_FLAGS = {"amx_tile", "amx_bf16", "avx512_bf16", "avx512vbmi"}
SHAPES = ((37, 200), (64, 256), (5, 20))  # ragged N and K (not multiples of 16/32/64), and K under one chunk
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# (input shape without K, dtype, bias): M = 1, 2 and 4, a 3-D input, more rows than one pass takes (8), M = 0
CASES = (
    ((1,), BF16, True),
    ((1,), FP32, False),
    ((2,), BF16, False),
    ((4,), BF16, True),
    ((2, 3), BF16, False),
    ((2, 3), FP32, True),
    ((9,), BF16, True),
    ((1,), FP16, True),
    ((0,), BF16, True),
)


def _isa_param(name: str) -> object:
    loops = "avx512" if name in ("amx", *DOT_LOOPS) else name
    runs = cpu_gemv.ISA_CHOICES.index(loops) <= cpu_gemv.ISA_CHOICES.index(cpu_gemv.supported_isa())
    runs = runs and (name != "amx" or AMX_FLAGS <= cpu_flags())
    runs = runs and (name not in DOT_LOOPS or "avx512_vnni" in cpu_flags())
    runs = runs and (name != "bf16dot" or "avx512_bf16" in cpu_flags())
    return pytest.param(name, marks=pytest.mark.skipif(not runs, reason=f"this CPU does not run {name}"))


@pytest.fixture(params=[_isa_param(name) for name in ISAS])
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    before = cpu_gemv.isa()
    cpu_gemv.set_isa("avx512" if request.param in ("amx", *DOT_LOOPS) else request.param)
    monkeypatch.setenv(AMX_VARIABLE, "all" if request.param == "amx" else "0")
    monkeypatch.setenv(INT16_VARIABLE, "1" if request.param in DOT_LOOPS else "0")
    monkeypatch.setenv(BF16DOT_VARIABLE, "1" if request.param == "bf16dot" else "0")
    try:
        yield request.param
    finally:
        cpu_gemv.set_isa(before)


@functools.cache
def weight_of(name: str, n: int, k: int, seed: int = 0) -> CanonicalWeight:
    scheme = builtin_scheme(name)
    return canonicalize(scheme, layer_tensors(scheme, n=n, k=k, seed=seed), n, k)


def storable(name: str, n: int, k: int) -> CanonicalWeight | None:
    try:
        return weight_of(name, n, k)
    except QuantizeError:
        return None  # the scheme's declared shapes need whole groups or blocks


def reference_input(weight: CanonicalWeight, x: torch.Tensor) -> torch.Tensor:
    """The float32 input the reference multiplies (pre-scaled, quantized), as [rows, K]."""
    kernel = ReferenceKernel()
    state = kernel.prepare(weight, CPU)
    pieces = kernel.quantize_input(state, x.reshape(-1, weight.k))
    return torch.stack([values for _, values in pieces]).abs().amax(dim=0)  # the largest per element


_ABSOLUTE: dict[int, tuple[CanonicalWeight, torch.Tensor]] = {}


def absolute_weight(weight: CanonicalWeight) -> torch.Tensor:
    """|dequantize(weight)| in float64, once per weight object."""
    if id(weight) not in _ABSOLUTE:
        _ABSOLUTE[id(weight)] = (weight, dequantize(weight).double().abs())
    return _ABSOLUTE[id(weight)][1]


def bf16dot_takes(weight: CanonicalWeight, rows: torch.Tensor) -> bool:
    """Whether the AVX512-BF16 loop multiplies these bfloat16 rows (as the loop takes them) by
    the weight here: the layer and the number of rows its own (cpu_gemv.dot_loop), and every
    element zero or of a magnitude in [2**-100, 2**64]."""
    codes_only = dataclasses.replace(weight, input_permutation=None, input_pre_scale=None)  # what the loop sees
    if cpu_gemv.dot_loop(cpu_gemv.layout_of(codes_only), rows.shape[0]) != "bf16":
        return False
    magnitude = rows.float().abs()
    return bool(((magnitude == 0) | ((magnitude >= 2.0**-100) & (magnitude <= 2.0**64))).all())


def int16_slack(weight: CanonicalWeight, x: torch.Tensor) -> torch.Tensor | float:
    """The VNNI loop's rounding of x, where it may run (one to four bfloat16 rows, the loop not
    turned off, the AVX512-BF16 loop not taking them): per row, sum_k |w_k| * half the step of k's
    block of 256 (k < K rounded down to 64), the step the smallest power of two that holds the
    block's largest |x| in 15 bits (cpu_gemv.py); [rows, N]."""
    rows = x.reshape(-1, weight.k)
    if x.dtype != torch.bfloat16 or not 1 <= rows.shape[0] <= 4 or os.environ.get(INT16_VARIABLE) == "0":
        return 0.0
    if rounds_pre_scaled_input(weight, x):
        assert weight.input_pre_scale is not None
        rows = apply_pre_scale(rows, weight.input_pre_scale).to(torch.bfloat16)  # what the loop takes
    if os.environ.get(BF16DOT_VARIABLE) != "0" and bf16dot_takes(weight, rows):
        return 0.0  # x as it is: the float32 bound
    k_main = weight.k // 64 * 64
    half = torch.zeros(rows.shape[0], weight.k, dtype=torch.float64)
    for row in range(rows.shape[0]):
        for start in range(0, k_main, 256):
            block = rows[row, start : min(k_main, start + 256)].double().abs()
            largest = float(block.max())
            if largest > 0:
                half[row, start : start + block.numel()] = 2.0 ** (math.floor(math.log2(largest)) - 15)
    return half @ absolute_weight(weight).t()


def rounds_pre_scaled_input(weight: CanonicalWeight, x: torch.Tensor) -> bool:
    """Whether the kernel rounds the pre-scaled input to bfloat16 (an AWQ layer, bfloat16 inputs)."""
    return weight.input_pre_scale is not None and weight.scheme.activation is None and x.dtype == torch.bfloat16


def check_close(weight: CanonicalWeight, x: torch.Tensor, y: torch.Tensor, expected: torch.Tensor) -> None:
    assert y.shape == expected.shape and y.dtype == expected.dtype == x.dtype
    magnitude = reference_input(weight, x).double() @ absolute_weight(weight).t()
    slack = int16_slack(weight, x)
    relative = (2 * weight.k + 8) * 2.0**-24 + (2.0**-9 if rounds_pre_scaled_input(weight, x) else 0.0)
    bound = relative * magnitude.reshape(y.shape)
    bound = bound + (slack.reshape(y.shape) if isinstance(slack, torch.Tensor) else slack)
    if x.dtype != torch.float32:
        ulp = 2.0**-7 if x.dtype == torch.bfloat16 else 2.0**-10  # one unit in the last place
        bound = bound + ulp * torch.maximum(y.double().abs(), expected.double().abs())
    error = (y.double() - expected.double()).abs()
    assert bool((error <= bound + 1e-30).all()), f"largest excess {float((error - bound).max()):.3e}"


def test_the_declaration_covers_the_issue_s_schemes() -> None:
    assert EXPECTED <= set(SCHEME_NAMES), sorted(EXPECTED - set(SCHEME_NAMES))
    # GGUF blocks, act-order and 2-bit codes are left to the other kernels
    assert not {name for name in SCHEME_NAMES if name.startswith("gguf/") or "W2A16" in name}


@pytest.mark.parametrize("name", SCHEME_NAMES)
def test_matches_the_reference_kernel(name: str, isa: str) -> None:
    kernel, reference = CpuGemvKernel(), ReferenceKernel()
    generator = torch.Generator().manual_seed(3)
    ran = 0
    for n, k in SHAPES:
        weight = storable(name, n, k)
        if weight is None:
            continue
        ran += 1
        state, expected_state = kernel.prepare(weight, CPU), reference.prepare(weight, CPU)
        bias = torch.randn(n, generator=generator)
        for shape, dtype, with_bias in CASES:
            x = torch.randn((*shape, k), generator=generator).to(dtype)
            b = bias.to(dtype) if with_bias else None
            check_close(weight, x, kernel.apply(state, x, b), reference.apply(expected_state, x, b))
    assert ran


# Several rows of x take K in blocks that keep their slice of x in L1 (6144 / M floats: 768 at
# M = 8, 1216 at M = 5): K = 2336 splits into several blocks, at M = 5 an edge inside a group of 128.
BLOCKED_SCHEMES = (
    "compressed-tensors/NVFP4A16",
    "compressed-tensors/W8A16_G32",
    "modelopt/fp8_pb_wo",
    "modelopt/W4A16_AWQ",
    "compressed-tensors/W4A16_ASYM",
)


@pytest.mark.parametrize("name", BLOCKED_SCHEMES)
def test_long_rows_in_blocks_of_k(name: str, isa: str) -> None:
    weight = storable(name, 24, 2336) or weight_of(name, 24, 2304)
    kernel, reference = CpuGemvKernel(), ReferenceKernel()
    state, expected_state = kernel.prepare(weight, CPU), reference.prepare(weight, CPU)
    generator = torch.Generator().manual_seed(5)
    for rows in (1, 3, 5, 8):
        x = torch.randn(rows, weight.k, generator=generator).to(torch.bfloat16)
        check_close(weight, x, kernel.apply(state, x, None), reference.apply(expected_state, x, None))


@pytest.mark.parametrize("name", ["compressed-tensors/NVFP4A16", "compressed-tensors/FP8", "modelopt/NVFP4"])
def test_fused_partitions_equal_the_separate_layers(name: str, isa: str) -> None:
    """Partitions with their own global (or per-tensor) scales: each partition's rows of the fused
    layer are the separate layer's output, bit for bit, and the whole within the bound."""
    members = [weight_of(name, rows, 96, seed) for rows, seed in ((16, 1), (32, 2), (8, 3))]
    fused = concatenate(members)
    scales = fused.global_scale if fused.global_scale is not None else fused.scale
    assert scales is not None and len(set(scales.reshape(-1).tolist())) == 3  # the partitions' scales differ
    kernel = CpuGemvKernel()
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    y = kernel.apply(kernel.prepare(fused, CPU), x, None)
    separate = torch.cat([kernel.apply(kernel.prepare(m, CPU), x, None) for m in members], dim=-1)
    assert torch.equal(y, separate)
    reference = ReferenceKernel()
    check_close(fused, x, y, reference.apply(reference.prepare(fused, CPU), x, None))


@pytest.mark.parametrize("name", SCHEME_NAMES)
def test_row_dequantization_is_the_reference_s(name: str, isa: str) -> None:
    weight = storable(name, 37, 200) or weight_of(name, 64, 256)
    layout = cpu_gemv.layout_of(weight)
    start, stop = 3, weight.n - 1
    rows = cpu_gemv.dequantize_rows(layout, start, stop)
    assert torch.equal(rows, dequantize_rows(weight, start, stop))
    into = torch.empty(stop - start, weight.k, dtype=torch.bfloat16)
    assert cpu_gemv.dequantize_rows(layout, start, stop, out=into) is into
    assert torch.equal(into, rows.to(torch.bfloat16))
    assert torch.equal(cpu_gemv.dequantize_rows(layout, 0, weight.n, threads=2), dequantize(weight))
    assert cpu_gemv.dequantize_rows(layout, 4, 4).shape == (0, weight.k)


def test_the_layer_arguments_are_built_once_and_not_copied() -> None:
    """A layout builds its extension arguments (its tensors' addresses) once; a deep copy or a
    pickle of it, whose tensors live elsewhere, builds its own, and multiplies as the original."""
    weight = weight_of("compressed-tensors/W4A16", 48, 256)
    layout = cpu_gemv.layout_of(weight)
    args = layout.layer_args
    assert args is layout.layer_args and args[0] == layout.codes.data_ptr()
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(4))
    expected = cpu_gemv.gemv(layout, x)
    for copied in (copy.deepcopy(layout), pickle.loads(pickle.dumps(layout))):
        assert copied.codes.data_ptr() != layout.codes.data_ptr()
        assert copied.layer_args[0] == copied.codes.data_ptr()
        assert torch.equal(cpu_gemv.gemv(copied, x), expected)


def test_awq_layers_give_the_extension_the_pre_scaled_input_in_bfloat16(monkeypatch: pytest.MonkeyPatch) -> None:
    """With bfloat16 inputs the pre-scaled input is rounded once to bfloat16 and passed to the
    extension in one call (its bfloat16 loops take it); float32 inputs keep the reference's
    float32 pre-scaled input."""
    weight = weight_of("modelopt/W4A16_AWQ", 48, 256)
    assert weight.input_pre_scale is not None
    kernel = CpuGemvKernel()
    state = kernel.prepare(weight, CPU)
    seen: list[torch.Tensor] = []
    original = cpu_gemv.gemv

    def recording(layout: cpu_gemv.GemvLayout, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        seen.append(x)
        return original(layout, x, bias)

    monkeypatch.setattr(cpu_gemv, "gemv", recording)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(8))
    bias = torch.randn(48, generator=torch.Generator().manual_seed(9))
    for dtype in (torch.bfloat16, torch.float32):
        seen.clear()
        rows = x.to(dtype)
        y = kernel.apply(state, rows, bias.to(dtype))
        assert len(seen) == 1 and seen[0].dtype == dtype
        assert torch.equal(seen[0], apply_pre_scale(rows, weight.input_pre_scale).to(dtype))
        reference = ReferenceKernel()
        check_close(weight, rows, y, reference.apply(reference.prepare(weight, CPU), rows, bias.to(dtype)))


@pytest.mark.parametrize("name", ["gptq/W4A16_ASYM_G32", "gptq/W4A16", "gptq/W8A16", "modelopt/W4A16_AWQ"])
def test_act_order_layers_permute_the_input_into_the_codes_order(name: str) -> None:
    """A canonical weight whose columns are the input channels permuted (GPTQ act-order) gives the
    reference's output within the bound (bf16 and float32, 1 to 5 rows, bias), the codes kept as
    stored; the resolver sends such layers here rather than to the reference kernel."""
    plain = weight_of(name, 40, 256)
    order = torch.randperm(256, generator=torch.Generator().manual_seed(6))
    weight = dataclasses.replace(plain, input_permutation=order)
    kernel, reference = CpuGemvKernel(), ReferenceKernel()
    state, expected_state = kernel.prepare(weight, CPU), reference.prepare(weight, CPU)
    assert state.layout.codes.data_ptr() == weight.codes.data_ptr()  # no copy
    generator = torch.Generator().manual_seed(7)
    bias = torch.randn(40, generator=generator)
    for dtype in (torch.bfloat16, torch.float32):
        for rows in (1, 3, 5):
            x = torch.randn(rows, 256, generator=generator).to(dtype)
            y = kernel.apply(state, x, bias.to(dtype))
            check_close(weight, x, y, reference.apply(expected_state, x, bias.to(dtype)))
    # the permutation matters: without it the output is another one
    unpermuted = kernel.apply(kernel.prepare(plain, CPU), x, bias.to(x.dtype))
    assert not torch.equal(unpermuted, kernel.apply(state, x, bias.to(x.dtype)))
    problem = Problem(4096, 4096, input_permutation=True)
    device = fake_device("cpu", modules=all_modules() | {CPU_GEMV.implementation_module or ""})
    resolution = resolve(builtin_scheme(name), problem, device, registry.declarations())
    assert resolution.kernel is not None and resolution.kernel.name == "cpu_gemv"
    assert not resolution.candidate("tinygemm_cpu").accepted  # which takes input channels in order


@pytest.mark.parametrize("isa_name", ["avx512", "avx2", "scalar"])
def test_every_float16_scale_decodes_as_torch_converts_it(isa_name: str) -> None:
    """Float16 scales (GPTQ's and AutoAWQ's) are converted eight at a time with F16C where the CPU
    has it, else one by one: every one of the 65,536 bit patterns gives torch's float32 value
    (NaN where it is NaN), in the dequantized rows and in the GEMV's group sums."""
    if isa_name not in cpu_gemv.ISA_CHOICES or (isa_name != "scalar" and cpu_gemv.supported_isa() == "scalar"):
        pytest.skip(f"this CPU runs no {isa_name} loop")
    weight = weight_of("gptq/W4A16_G32", 512, 4096)  # 512 x 128 scales, replaced by float16 ones below
    assert weight.scale is not None and weight.scale.shape == (512, 128)
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16).reshape(512, 128)
    crafted = dataclasses.replace(weight, scale=every.contiguous())
    before = cpu_gemv.isa()
    try:
        if isa_name != "avx512" or cpu_gemv.supported_isa() == "avx512":
            cpu_gemv.set_isa(isa_name)
        layout = cpu_gemv.layout_of(crafted)
        rows = cpu_gemv.dequantize_rows(layout, 0, 512)
        assert torch.equal(rows.isnan(), dequantize(crafted).isnan())
        finite = ~rows.isnan()
        assert torch.equal(rows[finite], dequantize(crafted)[finite])
        # the GEMV: x picks the first element of each group (one column per group), so each output
        # is the sum over its row's groups of value * scale; compare the rows whose scales are finite
        x = torch.zeros(1, 4096)
        x[0, ::32] = 1.0
        y = cpu_gemv.gemv(layout, x)
        expected = x @ dequantize(crafted).t()
        ok = torch.isfinite(every.float()).all(dim=1)
        torch.testing.assert_close(y[0, ok], expected[0, ok], rtol=2**-20, atol=0.0)
    finally:
        cpu_gemv.set_isa(before)


def magnitude_cases(names: tuple[str, ...], quiet: float) -> Iterator[tuple[str, CanonicalWeight, torch.Tensor]]:
    """(name, weight, x) for each scheme and 1 to 4 bfloat16 rows of x of very different
    magnitudes (rows 2**10 and 2**-12 apart, and elements 256-511 of each row times ``quiet``)."""
    generator = torch.Generator().manual_seed(7)
    for name in names:
        weight = storable(name, 24, 2336) or weight_of(name, 24, 2304)
        for rows in (1, 2, 3, 4):
            x = torch.randn(rows, weight.k, generator=generator)
            x = x * torch.tensor([1.0, 2.0**10, 2.0**-12, 3.0])[:rows, None]
            x[:, 256:512] *= quiet
            yield name, weight, x.to(torch.bfloat16)


def check_kernel(weight: CanonicalWeight, x: torch.Tensor) -> None:
    """cpu_gemv's output for x against the reference kernel's, within the bound."""
    kernel, reference = CpuGemvKernel(), ReferenceKernel()
    y = kernel.apply(kernel.prepare(weight, CPU), x, None)
    check_close(weight, x, y, reference.apply(reference.prepare(weight, CPU), x, None))


needs_vnni = pytest.mark.skipif(
    "avx512_vnni" not in cpu_flags() or cpu_gemv.supported_isa() != "avx512", reason="this CPU runs no AVX512-VNNI"
)
needs_bf16dot = pytest.mark.skipif(
    "avx512_bf16" not in cpu_flags() or cpu_gemv.supported_isa() != "avx512", reason="this CPU runs no AVX512-BF16"
)


def repeated(weight: CanonicalWeight, times: int) -> CanonicalWeight:
    """The weight's rows repeated `times` times (codes, and scales and zero points per row or group), one
    partition."""

    def rows(tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None or tensor.dim() == 0 or tensor.shape[0] != weight.n:
            return tensor  # per tensor or per partition: the same for every copy
        return tensor.repeat(times, *([1] * (tensor.dim() - 1)))

    return dataclasses.replace(
        weight,
        n=times * weight.n,
        partitions=(times * weight.n,) if weight.partitions else (),
        codes=rows(weight.codes),
        scale=rows(weight.scale),
        zero_point=rows(weight.zero_point),
    )


STREAM_SCHEMES = (
    "compressed-tensors/NVFP4A16",
    "compressed-tensors/MXFP4A16",
    "compressed-tensors/W4A16_ASYM",
    "compressed-tensors/W4A16",
    "compressed-tensors/FP8",
    "compressed-tensors/W8A16_G32",
)


@pytest.mark.parametrize("name", STREAM_SCHEMES)
def test_each_row_lands_in_its_place_over_streams_and_spans(name: str, isa: str) -> None:
    """Each loop reads a worker's rows as several streams, each a part of its span, the rest one at a
    time (row_streams.h). A row's output does not depend on which stream or worker read it: a tall
    weight of one 37-row slab repeated (259 rows: two workers' spans, streams of 31-66 rows and a
    remainder) gives, bit for bit, the slab's own output in every copy, on 1 and 2 threads."""
    if isa == "amx":
        pytest.skip("the tile path reads 16 rows at a time, not streams")
    slab = weight_of(name, 37, 256)
    tall = repeated(slab, 7)
    generator = torch.Generator().manual_seed(3)
    for m in (1, 3, 6):
        x = torch.randn(m, slab.k, generator=generator).to(BF16)
        own = cpu_gemv.gemv(cpu_gemv.layout_of(slab), x, threads=1)
        for threads in (1, 2):
            y = cpu_gemv.gemv(cpu_gemv.layout_of(tall), x, threads=threads)
            assert torch.equal(y, own.repeat(1, 7)), (name, isa, m, threads)


@needs_vnni
def test_the_vnni_loop_takes_up_to_four_bfloat16_rows_of_4_bit_codes(monkeypatch: pytest.MonkeyPatch) -> None:
    before = cpu_gemv.isa()
    cpu_gemv.set_isa("avx512")
    monkeypatch.setenv(AMX_VARIABLE, "0")
    monkeypatch.setenv(INT16_VARIABLE, "1")
    monkeypatch.setenv(BF16DOT_VARIABLE, "0")
    try:
        taken = ("compressed-tensors/NVFP4A16", "compressed-tensors/MXFP4A16", "compressed-tensors/W4A16")
        with_zeros = ("compressed-tensors/W4A16_ASYM", "gptq/W4A16_ASYM_G32", "gptq/W4A16_ASYM_CHANNEL")
        for name in taken + with_zeros:
            assert cpu_gemv.int16_applies(cpu_gemv.layout_of(weight_of(name, 64, 256))), name
        # byte codes keep the float32 loop
        for name in ("compressed-tensors/FP8", "compressed-tensors/W8A16_G32"):
            assert not cpu_gemv.int16_applies(cpu_gemv.layout_of(weight_of(name, 64, 256))), name
        nvfp4 = weight_of("compressed-tensors/NVFP4A16", 16, 256)
        # row 0: w[0] = 0 and w[1] = 6 * its scale; x: 1 at k = 0, 2**-20 at k = 1 (below half the
        # block's step, 2**-15), zero elsewhere: the integer loop rounds x[1] to 0, the float32 loop
        # keeps 6 * scale * 2**-20
        codes = nvfp4.codes.clone()
        codes[0, 0] = 0x70  # e2m1 code 7 (6.0) in the high nibble (k = 1), 0 in the low one (k = 0)
        crafted = dataclasses.replace(nvfp4, codes=codes)
        layout = cpu_gemv.layout_of(crafted)
        x = torch.zeros(1, 256)
        x[0, 0], x[0, 1] = 1.0, 2.0**-20
        x = x.to(torch.bfloat16)
        assert float(cpu_gemv.gemv(layout, x)[0, 0]) == 0.0
        monkeypatch.setenv(INT16_VARIABLE, "0")
        assert not cpu_gemv.int16_applies(layout)
        assert float(cpu_gemv.gemv(layout, x)[0, 0]) > 0.0
        # rows of x (and blocks of one row) of very different magnitudes: each block its own step
        monkeypatch.setenv(INT16_VARIABLE, "1")
        for _, weight, x in magnitude_cases(taken + with_zeros, 2.0**-5):
            check_kernel(weight, x)
    finally:
        cpu_gemv.set_isa(before)


# a block's largest |x| at the edges of the VNNI loop's range: (value, whether the loop takes the row);
# frexp's exponent of the value must lie in [-100, 100]
VNNI_EDGES = (
    (0.0, True),  # a block of zeros
    (2.0**-101, True),  # exponent -100
    (-(2.0**-102) * 1.5, False),  # exponent -101
    (2.0**-130, False),  # subnormal
    (2.0**99 * 1.5, True),  # exponent 100
    (-(2.0**100), False),  # exponent 101
    (float("inf"), False),
    (float("nan"), False),
)


@needs_vnni
@pytest.mark.parametrize(("value", "taken"), VNNI_EDGES)
def test_the_vnni_loop_takes_blocks_whose_largest_element_is_in_range(
    value: float, taken: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each block of 256 elements of a row is scaled by a power of two from its largest magnitude;
    outside the loop's range (or not finite) the call runs the float32 loops, bit for bit what they
    give with the VNNI loop off. The edge element meets zero weights; the next block's rounding to
    16 bits (its largest element, 256, also on a zero weight, the others about 2**-7) shows which
    loop ran."""
    before = cpu_gemv.isa()
    cpu_gemv.set_isa("avx512")
    monkeypatch.setenv(AMX_VARIABLE, "0")
    monkeypatch.setenv(BF16DOT_VARIABLE, "0")
    try:
        nvfp4 = weight_of("compressed-tensors/NVFP4A16", 16, 512)
        codes = nvfp4.codes.clone()
        codes[:, 0] &= 0xF0  # k = 0 and k = 256 (low nibbles) are +0 in every row
        codes[:, 128] &= 0xF0
        layout = cpu_gemv.layout_of(dataclasses.replace(nvfp4, codes=codes))
        x = torch.zeros(2, 512)
        x[:, 256:] = torch.randn(2, 256, generator=torch.Generator().manual_seed(5)) * 2.0**-7
        x[:, 256] = 256.0  # the block's step: 2**-6
        x[1, 0] = value
        x = x.to(torch.bfloat16)
        assert float(x[1, 0]) == value or math.isnan(value)
        monkeypatch.setenv(INT16_VARIABLE, "1")
        assert cpu_gemv.dot_loop(layout, 2) == "vnni"
        y = cpu_gemv.gemv(layout, x)
        monkeypatch.setenv(INT16_VARIABLE, "0")
        floats = cpu_gemv.gemv(layout, x)
        same_bits = torch.equal(y.view(torch.int16), floats.view(torch.int16))
        assert same_bits != taken
    finally:
        cpu_gemv.set_isa(before)


# Every scale group the 16-bit dot loops take (16 and 32 by the chunk's lanes, 64 by lane too, 128
# and the whole row at the chunk's end, with and without zero points), each with K a multiple of 128
# and an odd multiple of 64 (the last 64 a chunk of their own) and blocks of 256 cut short.
DOT_LOOP_GROUPS = (
    "compressed-tensors/NVFP4A16",
    "compressed-tensors/MXFP4A16",
    "gptq/W4A16_G64",
    "gptq/W4A16_ASYM_G64",
    "compressed-tensors/W4A16",
    "gptq/W4A16_ASYM_CHANNEL",
)


@needs_vnni
@pytest.mark.parametrize("name", DOT_LOOP_GROUPS)
@pytest.mark.parametrize("k", [384, 448, 576])
def test_the_dot_loops_take_every_group_and_a_last_chunk_of_64(
    name: str, k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The VNNI loop (and the AVX512-BF16 loop where the CPU has it and the layer fits it) runs the
    layer at M = 1 to 4 and matches the reference kernel within the bound, whether K ends on a chunk
    of 128 or with 64 more; a wrong lane group, a misplaced last chunk or a table not repeated over
    the index's fifth bit takes the sums far outside it."""
    before = cpu_gemv.isa()
    cpu_gemv.set_isa("avx512")
    monkeypatch.setenv(AMX_VARIABLE, "0")
    monkeypatch.setenv(INT16_VARIABLE, "1")
    try:
        weight = weight_of(name, 24, k)
        layout = cpu_gemv.layout_of(weight)
        generator = torch.Generator().manual_seed(k)
        loops = ["0", "1"] if "avx512_bf16" in cpu_flags() else ["0"]
        for loop in loops:
            monkeypatch.setenv(BF16DOT_VARIABLE, loop)
            for m in (1, 2, 3, 4):
                x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
                taken = cpu_gemv.dot_loop(layout, m)
                assert taken == "vnni" or (loop == "1" and taken == "bf16"), (loop, m, taken)
                check_kernel(weight, x)
    finally:
        cpu_gemv.set_isa(before)


@needs_vnni
def test_the_vnni_loop_subtracts_zero_points_exactly_and_leaves_large_ones_to_the_float_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Zero points are subtracted in 32-bit integers (a code equal to its zero point gives
    exactly zero whatever x); zero points beyond 2047 (times the table's factor) would overflow
    them, so such a layer runs the float32 loop, with the reference's result either way."""
    before = cpu_gemv.isa()
    cpu_gemv.set_isa("avx512")
    monkeypatch.setenv(AMX_VARIABLE, "0")
    monkeypatch.setenv(INT16_VARIABLE, "1")
    monkeypatch.setenv(BF16DOT_VARIABLE, "0")
    try:
        weight = weight_of("gptq/W4A16_ASYM", 16, 512)
        assert weight.zero_point is not None
        # every code of row 0 equals its group's zero point: the row's weights are all zero
        zero = weight.zero_point.clone()
        codes = weight.codes.clone()
        zero[0] = 5
        codes[0] = 0x55
        crafted = dataclasses.replace(weight, codes=codes, zero_point=zero)
        layout = cpu_gemv.layout_of(crafted)
        assert cpu_gemv.int16_applies(layout)
        x = (torch.randn(4, 512, generator=torch.Generator().manual_seed(3)) * 1e4).to(torch.bfloat16)
        y = cpu_gemv.gemv(layout, x)
        assert torch.equal(y[:, 0], torch.zeros(4, dtype=torch.bfloat16))
        kernel, reference = CpuGemvKernel(), ReferenceKernel()
        check_close(crafted, x, y, reference.apply(reference.prepare(crafted, CPU), x, None))
        large = weight.zero_point.clone()
        large[3, 0] = 3000
        far = dataclasses.replace(weight, zero_point=large)
        assert not cpu_gemv.int16_applies(cpu_gemv.layout_of(far))
        y = kernel.apply(kernel.prepare(far, CPU), x, None)
        check_close(far, x, y, reference.apply(reference.prepare(far, CPU), x, None))
    finally:
        cpu_gemv.set_isa(before)


@needs_vnni
@pytest.mark.parametrize("loop", [pytest.param("vnni"), pytest.param("bf16", marks=needs_bf16dot)])
@pytest.mark.parametrize("name", ["compressed-tensors/NVFP4A16", "modelopt/W4A16_NVFP4", "compressed-tensors/MXFP4A16"])
def test_the_dot_loops_decode_every_scale_byte_as_its_table_says(
    name: str, loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """e4m3 and e8m0 scale bytes are decoded by arithmetic in the VNNI and AVX512-BF16 loops (with
    the row's global scale multiplied or divided as the table is): each byte value, subnormal and
    NaN ones too, gives the reference's output (NaN where a group's scale is NaN)."""
    weight = weight_of(name, 16, 1024)
    assert weight.scale is not None
    raw = weight.scale.view(torch.uint8).clone()
    # every e4m3 byte; e8m0 bytes up to 2**10 (larger ones overflow float32 sums, in another order
    # than the reference's) and 255 (NaN)
    every = torch.arange(256) if "NVFP4" in name else torch.cat([torch.arange(138), torch.tensor([255])])
    every = every[torch.randperm(every.numel(), generator=torch.Generator().manual_seed(2))].to(torch.uint8)
    raw.view(-1)[: every.numel()] = every
    crafted = dataclasses.replace(weight, scale=raw.view(weight.scale.dtype))
    before = cpu_gemv.isa()
    cpu_gemv.set_isa("avx512")
    monkeypatch.setenv(AMX_VARIABLE, "0")
    monkeypatch.setenv(INT16_VARIABLE, "1")
    monkeypatch.setenv(BF16DOT_VARIABLE, "1" if loop == "bf16" else "0")
    try:
        x = torch.randn(3, crafted.k, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
        layout = cpu_gemv.layout_of(crafted)
        assert cpu_gemv.dot_loop(layout, 3) == loop
        expected = ReferenceKernel().apply(ReferenceKernel().prepare(crafted, CPU), x, None)
        assert bool(expected.isnan().any())
        assert torch.equal(cpu_gemv.gemv(layout, x).isnan(), expected.isnan())
        # the NaN bytes made zero (byte 0: e4m3 0, e8m0 2**-127): every other value within the bound
        nan_bytes = torch.tensor([0x7F, 0xFF] if "NVFP4" in name else [0xFF], dtype=torch.uint8)
        finite = dataclasses.replace(crafted, scale=torch.where(torch.isin(raw, nan_bytes), 0, raw).view(raw.dtype))
        finite = dataclasses.replace(finite, scale=finite.scale.view(weight.scale.dtype))
        y = cpu_gemv.gemv(cpu_gemv.layout_of(finite), x)
        check_close(finite, x, y, ReferenceKernel().apply(ReferenceKernel().prepare(finite, CPU), x, None))
    finally:
        cpu_gemv.set_isa(before)


@needs_vnni
@needs_bf16dot
def test_the_bf16_loop_takes_x_as_it_is_on_layers_without_zero_points(monkeypatch: pytest.MonkeyPatch) -> None:
    before = cpu_gemv.isa()
    cpu_gemv.set_isa("avx512")
    monkeypatch.setenv(AMX_VARIABLE, "0")
    monkeypatch.setenv(INT16_VARIABLE, "1")
    monkeypatch.setenv(BF16DOT_VARIABLE, "1")
    try:
        small_groups = ("compressed-tensors/NVFP4A16", "modelopt/W4A16_NVFP4", "compressed-tensors/MXFP4A16")
        small_groups += ("compressed-tensors/W4A16_G32",)
        large_groups = ("compressed-tensors/W4A16", "gptq/W4A16")
        with_zeros = ("compressed-tensors/W4A16_ASYM", "gptq/W4A16_ASYM_G32", "gptq/W4A16_ASYM_CHANNEL")
        for name in small_groups + large_groups + with_zeros:
            layout = cpu_gemv.layout_of(weight_of(name, 64, 256))
            loops = [cpu_gemv.dot_loop(layout, rows) for rows in (1, 2, 3, 4, 5)]
            if name in small_groups:
                assert loops == ["bf16"] * 4 + [None], name
            elif name in large_groups:  # one row: the VNNI loop was faster
                assert loops == ["vnni"] + ["bf16"] * 3 + [None], name
            else:
                assert loops == ["vnni"] * 4 + [None], name
        # byte codes keep the float32 loop
        assert cpu_gemv.dot_loop(cpu_gemv.layout_of(weight_of("compressed-tensors/FP8", 64, 256))) is None
        nvfp4 = weight_of("compressed-tensors/NVFP4A16", 16, 256)
        # row 0: w[0] = w[2] = w[3] = 0 and w[1] = 6 * its scale; x: 1 at k = 0, 2**-20 at k = 1, zero
        # elsewhere: the bfloat16 loop keeps x[1] (the integer loop rounds it to 0), its one product
        # the reference's
        codes = nvfp4.codes.clone()
        codes[0, 0], codes[0, 1] = 0x70, 0x00
        crafted = dataclasses.replace(nvfp4, codes=codes)
        layout = cpu_gemv.layout_of(crafted)
        x = torch.zeros(1, 256)
        x[0, 0], x[0, 1] = 1.0, 2.0**-20
        expected = ReferenceKernel().apply(ReferenceKernel().prepare(crafted, CPU), x.to(torch.bfloat16), None)
        y = cpu_gemv.gemv(layout, x.to(torch.bfloat16))
        assert float(y[0, 0]) > 0.0 and torch.equal(y[0, 0], expected[0, 0])
        # an element of x out of [2**-100, 2**64] (here where w is zero): the VNNI loop takes the row
        # (the bfloat16 values next to the range's ends included)
        for outside in (2.0**-110, 2.0**70, -(2.0**70), 2.0**64 * (1 + 2**-7), -(2.0**-101) * (2 - 2**-7)):
            x[0, 2] = outside
            assert float(cpu_gemv.gemv(layout, x.to(torch.bfloat16))[0, 0]) == 0.0, outside
        for inside in (2.0**64, -(2.0**-100)):
            x[0, 2] = inside
            assert float(cpu_gemv.gemv(layout, x.to(torch.bfloat16))[0, 0]) > 0.0, inside
        x[0, 2] = 2.0**-100
        monkeypatch.setenv(BF16DOT_VARIABLE, "0")
        assert cpu_gemv.dot_loop(layout) == "vnni"
        assert float(cpu_gemv.gemv(layout, x.to(torch.bfloat16))[0, 0]) == 0.0
        # rows of x (and blocks of one row) of very different magnitudes: within the float32 bound
        monkeypatch.setenv(BF16DOT_VARIABLE, "1")
        for name, weight, x in magnitude_cases(small_groups + large_groups, 2.0**-20):
            assert bf16dot_takes(weight, x) == (name in small_groups or x.shape[0] > 1), (name, x.shape)
            check_kernel(weight, x)
    finally:
        cpu_gemv.set_isa(before)


@needs_vnni
@needs_bf16dot
def test_the_bf16_loop_is_off_by_default_on_amx_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset, QSCHEME_CPU_GEMV_BF16DOT means the bfloat16 loop except on CPUs with AMX-BF16 (Intel's, where
    VDPBF16PS issues at half the FMA's rate: the integer loop was faster there); 0 and 1 override."""
    before = cpu_gemv.isa()
    cpu_gemv.set_isa("avx512")
    monkeypatch.setenv(AMX_VARIABLE, "0")
    monkeypatch.setenv(INT16_VARIABLE, "1")
    try:
        layout = cpu_gemv.layout_of(weight_of("compressed-tensors/NVFP4A16", 64, 256))
        monkeypatch.delenv(BF16DOT_VARIABLE, raising=False)
        default = "vnni" if "amx_bf16" in cpu_flags() else "bf16"
        assert [cpu_gemv.dot_loop(layout, rows) for rows in (1, 2, 4)] == [default] * 3
        for setting, loop in (("0", "vnni"), ("1", "bf16")):
            monkeypatch.setenv(BF16DOT_VARIABLE, setting)
            assert cpu_gemv.dot_loop(layout) == loop, setting
    finally:
        cpu_gemv.set_isa(before)


@needs_vnni
def test_the_tiles_take_four_rows_of_byte_scaled_groups_of_32(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the tile path runs (AMX-BF16, VBMI, the tile state granted), 4-bit codes with byte scales in
    groups of 32 or more (MXFP4) take it from M = 4, ahead of the 16-bit loops; other 4-bit layers keep
    those loops up to M = 4. QSCHEME_CPU_GEMV_AMX=0 keeps the 16-bit loops, =all sends every M to the
    tiles. Both give the reference within the kernel's bound at M = 4."""
    before = cpu_gemv.isa()
    cpu_gemv.set_isa("avx512")
    monkeypatch.delenv(INT16_VARIABLE, raising=False)
    monkeypatch.delenv(BF16DOT_VARIABLE, raising=False)
    try:
        mxfp4 = weight_of("compressed-tensors/MXFP4A16", 64, 256)
        layouts = {
            "compressed-tensors/NVFP4A16": cpu_gemv.layout_of(weight_of("compressed-tensors/NVFP4A16", 64, 256)),
            "compressed-tensors/MXFP4A16": cpu_gemv.layout_of(mxfp4),
        }
        tiles = AMX_FLAGS <= cpu_flags()
        for setting in ("", "0", "all"):
            monkeypatch.setenv(AMX_VARIABLE, setting)
            for name, layout in layouts.items():
                loops = [cpu_gemv.dot_loop(layout, rows) for rows in (1, 2, 3, 4)]
                takes_four = tiles and (setting == "" and name.endswith("MXFP4A16"))
                if tiles and setting == "all":
                    assert loops == [None] * 4, (name, setting)
                else:
                    assert [loop is None for loop in loops] == [False, False, False, takes_four], (name, setting)
            x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
            check_kernel(mxfp4, x)
    finally:
        cpu_gemv.set_isa(before)


def test_the_state_is_the_canonical_tensors() -> None:
    for name in ("compressed-tensors/NVFP4A16", "compressed-tensors/W8A16_G32", "modelopt/fp8_pb_wo"):
        weight = weight_of(name, 64, 256)
        layout = CpuGemvKernel().prepare(weight, CPU).layout
        canonical = {t.untyped_storage().data_ptr() for t in weight.kernel_tensors().values()}
        held = layout.tensors()
        assert held["codes"].untyped_storage().data_ptr() in canonical
        if "scale" in held:
            assert held["scale"].untyped_storage().data_ptr() in canonical
        extra = sum(t.numel() * t.element_size() for key, t in held.items() if key not in ("codes", "scale"))
        assert extra <= 4 * weight.n + 4 * (16 + 256), (name, extra)


def test_the_resolver_routes_cpu_layers() -> None:
    """On a CPU (without the Triton interpreter, a test path whose kernel outranks this one) at M = 1."""
    device = fake_device("cpu", modules=all_modules() | {CPU_GEMV.implementation_module or ""})
    declarations = registry.declarations()

    def chosen(name: str, dtype: str = "bfloat16") -> str:
        resolution = resolve(builtin_scheme(name), Problem(4096, 4096, dtype), device, declarations)
        assert resolution.kernel is not None
        return resolution.kernel.name

    for name in ("compressed-tensors/NVFP4A16", "compressed-tensors/MXFP4A16", "compressed-tensors/FP8"):
        assert chosen(name) == "cpu_gemv"
    assert chosen("compressed-tensors/W8A16_G32", "float32") == "cpu_gemv"
    # int4 and uint4 codes rank above tinygemm_cpu (its entry's priority), for every input dtype
    for name in ("compressed-tensors/W4A16", "compressed-tensors/W4A16_ASYM", "gptq/W4A16", "awq/W4A16_ASYM"):
        assert chosen(name) == chosen(name, "float32") == "cpu_gemv", name
    # without cpu_gemv they go back to tinygemm_cpu (bf16 only)
    without = resolve(builtin_scheme("gptq/W4A16"), Problem(4096, 4096), device, declarations, disabled=["cpu_gemv"])
    assert without.kernel is not None and without.kernel.name == "tinygemm_cpu"


def test_quant_linear_runs_it() -> None:
    weight = weight_of("compressed-tensors/NVFP4A16", 64, 256)
    bias = torch.randn(64)
    layer = QuantLinear.from_canonical(weight, kernel="cpu_gemv", bias=bias)
    x = torch.randn(2, 3, 256).to(torch.bfloat16)
    expected = QuantLinear.from_canonical(weight, kernel="reference", bias=bias)(x)
    check_close(weight, x, layer(x), expected)


def test_the_extension_check_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    problem = Problem(64, 256)
    assert NativeLoops().check(problem).ok == (cpu_gemv.supported_isa() != "scalar")

    def missing(name: str) -> object:
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr("qscheme_plugins.cpu_gemv.importlib.import_module", missing)
    result = NativeLoops().check(problem)
    assert not result.ok and "qscheme._cpu_gemv is not built" in result.reason and "C++17" in result.hint


def test_the_isa_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_gemv.isa() in cpu_gemv.ISA_CHOICES
    with pytest.raises(UsageError, match="avx9"):
        cpu_gemv.set_isa("avx9")
    monkeypatch.setenv(cpu_gemv.ISA_VARIABLE, "scalar")
    assert cpu_gemv.isa() == "scalar"
    monkeypatch.setenv(cpu_gemv.ISA_VARIABLE, "fast")
    with pytest.raises(UsageError, match="QSCHEME_CPU_GEMV_ISA"):
        cpu_gemv.isa()
    monkeypatch.delenv(cpu_gemv.ISA_VARIABLE)
    assert cpu_gemv.isa() == cpu_gemv.supported_isa()


# (scheme, N, K) for the tile path's edges, each called through cpu_gemv.gemv (the weight alone):
# byte codes with a tensor scale and K = 216 (six chunks of 32 columns, a half chunk, a K tail of 8),
# channel scales and a half chunk, NVFP4's folded e4m3 scales with a ragged block of rows and a K
# tail, MXFP4 with a scale whose products the fold cannot take (that row runs the float32 loop),
# group sums (int8 g32: eight groups; int4 g128) and 128x128 block scales over ragged rows
TILE_CASES = (
    ("compressed-tensors/FP8", 33, 216),
    ("compressed-tensors/FP8_DYNAMIC", 40, 208),
    ("compressed-tensors/NVFP4A16", 37, 208),
    ("compressed-tensors/MXFP4A16", 19, 256),
    ("compressed-tensors/W8A16_G32", 40, 256),
    ("compressed-tensors/W4A16", 24, 256),
    ("modelopt/fp8_pb_wo", 130, 256),
)


@pytest.mark.parametrize(("name", "n", "k"), TILE_CASES)
def test_the_tile_path_s_edges(name: str, n: int, k: int, isa: str) -> None:
    weight = weight_of(name, n, k)
    if name.endswith("MXFP4A16"):
        scale = weight.scale.clone() if weight.scale is not None else None
        assert scale is not None and scale.dtype == torch.uint8
        scale[3, 1] = 1  # 2**-126: half of it is a bfloat16 subnormal
        weight = dataclasses.replace(weight, scale=scale)
    layout = cpu_gemv.layout_of(weight)
    w = dequantize(weight).double()
    generator = torch.Generator().manual_seed(5)
    bias = torch.randn(n, generator=generator)
    for rows in (1, 4, 17):  # 17: two passes of at most 16 input rows
        x = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
        if rows == 4:
            x[2, 5] = 2.0**-110  # too small for the tiles: the float32 loop runs this call
        for given in (x, x.float()):  # a float32 x of bfloat16 values takes the tiles too
            y = cpu_gemv.gemv(layout, given, bias)
            exact = given.double() @ w.t() + bias.double()
            bound = (2 * k + 8) * 2.0**-24 * (given.double().abs() @ w.abs().t())
            if given.dtype == torch.bfloat16:
                bound = bound + 2.0**-8 * exact.abs()  # the output's rounding (half a unit, and the bias)
            error = (y.double() - exact).abs()
            assert bool((error <= bound + 1e-30).all()), (rows, given.dtype, float((error - bound).max()))


def test_scaled_codes_take_the_factored_path() -> None:
    """Per-tensor and per-token FP8 and int8 activations reach the GEMV as their code values (one
    scale per row applied to the output); NVFP4's block-scaled activations as the reference's input."""
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    for name, factored in (
        ("compressed-tensors/FP8", True),
        ("compressed-tensors/FP8_DYNAMIC", True),
        ("compressed-tensors/W8A8", True),
        ("compressed-tensors/NVFP4", False),
    ):
        state = CpuGemvKernel().prepare(weight_of(name, 64, 256), CPU)
        assert state.emulation is not None
        found = scaled_codes(state.emulation, x.float())
        assert (found is not None) == factored, name
        if found is not None:
            (_, _, codes, factor), *_ = found
            values = ReferenceKernel().quantize_input(state.emulation, x.float())[0][1]
            assert torch.equal(codes * factor, values)  # the reference's input, factored


def test_refusals_are_typed() -> None:
    with pytest.raises(UsageError, match="packed blocks"):
        cpu_gemv.layout_of(weight_of("gguf/Q4_0", 8, 64))
    layout = cpu_gemv.layout_of(weight_of("compressed-tensors/NVFP4A16", 64, 256))
    with pytest.raises(UsageError, match=r"\[M, 256\]"):
        cpu_gemv.gemv(layout, torch.randn(2, 255))
    with pytest.raises(UsageError, match="not within N=64"):
        cpu_gemv.dequantize_rows(layout, 10, 65)
    state = CpuGemvKernel().prepare(weight_of("compressed-tensors/NVFP4A16", 64, 256), CPU)
    with pytest.raises(UsageError, match="K=256"):
        CpuGemvKernel().apply(state, torch.randn(3, 128), None)


def test_the_ops_have_fake_implementations() -> None:
    layout = cpu_gemv.layout_of(weight_of("compressed-tensors/MXFP4A16", 64, 256))
    tensors = (layout.codes, layout.scale, layout.zero_point, layout.row_scale)
    x = torch.randn(2, 256).to(torch.bfloat16)
    torch.library.opcheck(
        torch.ops.qscheme.cpu_gemv.default, (x, *tensors, torch.randn(64), layout.lut, layout.scale_table,
                                            list(layout.meta), 1),
        test_utils=("test_schema", "test_faketensor"),
    )  # fmt: skip
    torch.library.opcheck(
        torch.ops.qscheme.cpu_gemv_dequantize.default,
        (*tensors, layout.lut, layout.scale_table, list(layout.meta), 2, 10, torch.bfloat16, 1),
        test_utils=("test_schema", "test_faketensor"),
    )
    compiled = torch.compile(lambda v: cpu_gemv.gemv(layout, v), fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), cpu_gemv.gemv(layout, x))
