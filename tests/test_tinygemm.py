"""torch's tinygemm int4 kernels (``tinygemm`` on CUDA, ``tinygemm_cpu``) against the reference
kernel: the weight they effectively use (exactly the reference's for bfloat16 scales without zero
points, else within the bound their declarations state), their outputs within that bound plus
bfloat16 input and output rounding, padding of ragged shapes, fused layers, AWQ pre-scales, the
resolution that picks or rejects them, and the memory a layer keeps. CUDA tests are marked gpu.

Tolerances (per weight, float64, s the reference's float32 scale, u - 8 the value tinygemm
scales: q for int4 codes, q - 8 for uint4 codes, zero = (8 - offset - z) * s):
    |w_tinygemm - w_reference| <= |u - 8| * |s - bf16(s)| + half a bfloat16 ulp of |zero|
                                  + 2**-23 * |w| (float32 roundings)
                                  [+ half a bfloat16 ulp of |w| on CUDA: its fma rounds to bf16]
and per output: that bound times |x|, the input's rounding to bfloat16 (after a pre-scale) times
|W|, float32 accumulation (K * 2**-24 of |x| @ |W|), and 2**-8 of the output (bfloat16 rounding,
again after a bias).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from kernel_fakes import builtin_scheme, builtin_schemes, layer_tensors
from qscheme_plugins import tinygemm_kernel as tk
from qscheme_plugins.tinygemm import TINYGEMM, TINYGEMM_CPU
from qscheme_plugins.tinygemm_kernel import TinygemmCpuKernel, TinygemmKernel
from torch import Tensor

from qscheme.canonical import CanonicalWeight, canonicalize, dequantize, effective_scale, element_values
from qscheme.checkpoint.fuse import concatenate
from qscheme.descriptor import Scheme, parse_scheme_text
from qscheme.errors import UsageError
from qscheme.kernels import registry
from qscheme.kernels.declaration import KernelDeclaration
from qscheme.kernels.devices import DeviceFacts, simulated_device
from qscheme.kernels.problem import Problem
from qscheme.kernels.resolver import Resolution, SchemeFeatures, check_layout, check_scheme
from qscheme.modules import QuantLinear
from qscheme.triton.samples import random_weight

CPU = torch.device("cpu")
BF16 = torch.bfloat16
INT4_SCHEMES = (
    "compressed-tensors/W4A16",
    "compressed-tensors/W4A16_ASYM",
    "compressed-tensors/W4A16_G32",
    "modelopt/W4A16_AWQ",
)
BLOCK_SCHEMES = ("gguf/Q4_0", "gguf/Q4_1", "gguf/Q4_K")  # tests/test_tinygemm_blocks.py
# GPTQ and AWQ load into compressed-tensors' int4 tensors (tests/test_gptq_awq_layout.py)
PRODUCER_INT4_SCHEMES = (
    *(
        f"{folder}/W4A16{sym}{group}"
        for folder in ("gptq", "gptq_v2")
        for sym in ("", "_ASYM")
        for group in ("", "_G32", "_G64", "_CHANNEL")
    ),
    "awq/W4A16_ASYM",
)
GROUP_SIZES = (32, 64, 128, 256)

UINT4_CHANNEL = """
name: test/UINT4_CHANNEL_ZP
weight:
  format: uint4
  packing: nibbles_k
  tensor: {name: weight, dtype: uint8, shape: [N, "ceil(K/2)"]}
  scale: {granularity: channel, format: fp16, stored: multiplier,
          tensor: {name: weight_scale, dtype: float16, shape: [N, 1]}}
  zero_point: {format: uint4, tensor: {name: weight_zero_point, dtype: uint8, shape: [N, 1]}}
activation: none
"""

UINT4_SYMMETRIC_G64 = """
name: test/UINT4_G64
weight:
  format: uint4
  packing: nibbles_k
  tensor: {name: weight, dtype: uint8, shape: [N, "ceil(K/2)"]}
  scale: {granularity: group, group_size: 64, format: bf16, stored: multiplier,
          tensor: {name: weight_scale, dtype: bfloat16, shape: [N, "ceil(K/64)"]}}
activation: none
"""

INT4_G16 = """
name: test/INT4_G16
weight:
  format: int4
  packing: nibbles_k
  tensor: {name: weight, dtype: uint8, shape: [N, "ceil(K/2)"]}
  scale: {granularity: group, group_size: 16, format: bf16, stored: multiplier,
          tensor: {name: weight_scale, dtype: bfloat16, shape: [N, "ceil(K/16)"]}}
activation: none
"""


def with_group(name: str, group: int) -> Scheme:
    """A built-in int4 scheme with its groups of 128 changed to ``group`` (its YAML, edited)."""
    scheme = builtin_scheme(name)
    if group == 128:
        return scheme
    assert scheme.path is not None
    text = Path(scheme.path).read_text().replace(f"name: {name}", f"name: test/{name.split('/')[1]}_G{group}")
    return parse_scheme_text(text.replace("128", str(group)))


# Every scheme form the kernels claim: the built-ins at every group size, and uint4 codes with
# channel scales and zero points, or groups without zero points.
# schemes of group 128 that with_group re-declares at each group size (W4A16_G32 is one of them at 32)
CLAIMED = [(name, group) for name in INT4_SCHEMES if not name.endswith("_G32") for group in GROUP_SIZES]


def claimed_scheme(name: str, group: int) -> Scheme:
    return with_group(name, group)


def storable_k(scheme: Scheme, k: int, n: int = 48) -> int:
    """``k``, or the next K the scheme's declared shapes can store (AWQ scales are [N, K/128])."""
    while check_layout(scheme, Problem(n, k)) is not None:
        k += 1
    return k


# --- what the kernels use and how far it may be from the reference ------------------------------


def _columns(values: Tensor, scheme: Scheme, k: int) -> Tensor:
    if values.shape[1] == 1:
        return values.expand(-1, k)
    group = scheme.weight.scale.group_size
    assert group is not None
    return values.repeat_interleave(group, dim=1)[:, :k]


def half_ulp_bf16(values: Tensor) -> Tensor:
    """Half a bfloat16 ulp (8 significant bits) of each |value| (subnormals' below 2**-126)."""
    exponent = torch.floor(torch.log2(values.abs().clamp_min(2.0**-126)))
    return torch.exp2(exponent - 8)


def weight_bound(weight: CanonicalWeight, cuda: bool = False) -> Tensor:
    """float64 [N, K]: the stated bound on |w_tinygemm - w_reference| (module docstring)."""
    scheme, k = weight.scheme, weight.k
    offset = 8 if scheme.weight.format == "int4" else 0
    scaled = element_values(weight).double() + offset - 8  # u - 8
    scale = effective_scale(weight)
    s = _columns(scale.double(), scheme, k)
    rounded = _columns(scale.to(BF16).double(), scheme, k)
    z = 0.0 if weight.zero_point is None else _columns(weight.zero_point.double(), scheme, k)
    zero = (8 - offset - z) * s
    reference = dequantize(weight).double().abs()
    bound = scaled.abs() * (s - rounded).abs() + half_ulp_bf16(zero)
    bound = bound + 2.0**-23 * (reference + bound)
    if cuda:
        bound = bound + half_ulp_bf16(reference + bound)
    return bound


def effective_weight_cpu(kernel: TinygemmCpuKernel, weight: CanonicalWeight) -> Tensor:
    """The float32 weight the CPU op dequantizes (exactly: identity input, float32 op, whose
    dequantization is the bfloat16 op's: float32 fma of the widened bfloat16 scales and zeros)."""
    state = kernel.prepare(replace(weight, input_pre_scale=None), CPU)
    eye = torch.eye(state.padded_k)
    pairs = state.scales_and_zeros.float()
    full = torch._weight_int4pack_mm_for_cpu(eye, state.packed, state.group_size, pairs)
    return full.t()[: weight.n, : weight.k]


def expected_and_bound(
    weight: CanonicalWeight,
    x: Tensor,
    bias: Tensor | None,
    device: torch.device,
    cuda: bool = False,
    used: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The reference kernel's float64 output for bfloat16 ``x`` (its weight: ``dequantize()``)
    and the stated tolerance; with ``used`` (the [N, K] weight the op was shown to use, checked
    against the reference's by ``weight_bound`` on its own), the output of that weight and the
    tolerance of the GEMM alone: input rounding, float32 accumulation, output rounding."""
    w = dequantize(weight).double() if used is None else used.double().cpu()
    inputs = x.float().cpu()
    if weight.input_pre_scale is not None:
        inputs = inputs * weight.input_pre_scale.float()  # as the reference: float32
    fed = inputs.to(BF16).double()  # what tinygemm multiplies
    w_bound = weight_bound(weight, cuda) if used is None else torch.zeros_like(w)
    w_abs = w.abs() + w_bound
    exact = inputs.double() @ w.T
    error = (fed - inputs.double()).abs() @ w_abs.T + inputs.double().abs() @ w_bound.T
    error = error + weight.k * 2.0**-24 * (fed.abs() @ w_abs.T)
    rounding = 2.0**-8 * (exact.abs() + error)
    if bias is not None:
        exact = exact + bias.double().cpu()
        rounding = rounding + 2.0**-8 * (exact.abs() + error + rounding)
    return exact, error + rounding


def assert_within(actual: Tensor, expected: Tensor, bound: Tensor, what: str) -> None:
    assert actual.dtype == BF16 and actual.shape == expected.shape, (
        f"{what}: {actual.dtype} {tuple(actual.shape)}, expected bfloat16 {tuple(expected.shape)}"
    )
    error = (actual.double().cpu() - expected).abs()
    excess = float((error - bound).max())
    assert excess <= 0, f"{what}: max error {float(error.max()):.3e} exceeds the bound by {excess:.3e}"
    # the bound is a statement about bfloat16 rounding, not a blanket: a few percent at most
    assert float(bound.max()) <= 0.05 * float(expected.abs().max()), f"{what}: bound too loose to mean anything"


# --- declarations and resolution ----------------------------------------------------------------


@pytest.mark.subprocess
def test_the_declaration_module_imports_no_torch() -> None:
    code = "import sys, qscheme_plugins.tinygemm; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize("declaration", [TINYGEMM, TINYGEMM_CPU], ids=["tinygemm", "tinygemm_cpu"])
def test_both_kernels_claim_exactly_the_builtin_int4_weight_only_schemes(declaration: KernelDeclaration) -> None:
    claimed = {s.name for s in builtin_schemes() if check_scheme(declaration, SchemeFeatures.of(s))[0]}
    assert claimed == set(INT4_SCHEMES) | set(BLOCK_SCHEMES) | set(PRODUCER_INT4_SCHEMES)
    for name, group in CLAIMED:
        assert check_scheme(declaration, SchemeFeatures.of(claimed_scheme(name, group)))[0]
    assert check_scheme(declaration, SchemeFeatures.of(parse_scheme_text(UINT4_CHANNEL)))[0]


def _resolve(
    scheme: Scheme,
    device: str | DeviceFacts,
    dtype: str = "bfloat16",
    n: int = 4096,
    k: int = 4096,
    environ: dict[str, str] | None = None,
) -> Resolution:
    return registry.resolve_layer(scheme, Problem(n, k, dtype), device=device, environ=environ or {})


# cpu_gemv's int4 entry ranks above tinygemm_cpu (62 > 60): without it, tinygemm_cpu runs int4 on a CPU
WITHOUT_CPU_GEMV = {"QSCHEME_DISABLED_KERNELS": "cpu_gemv"}


@pytest.mark.parametrize("name", INT4_SCHEMES)
def test_the_cpu_picks_tinygemm_cpu_for_bfloat16_and_leaves_other_dtypes_to_slower_paths(name: str) -> None:
    scheme = builtin_scheme(name)
    for n, k in ((4096, 4096), (50, storable_k(scheme, 200))):  # the second padded
        chosen = _resolve(scheme, "cpu", n=n, k=k, environ=WITHOUT_CPU_GEMV).kernel
        assert chosen is not None and chosen.name == "tinygemm_cpu"
        first = _resolve(scheme, "cpu", n=n, k=k)
        # cpu_gemv ranks above it for groups of 64 or more and groups of 32 without zero points (its
        # int4 entries), below it for groups of 32 with zero points
        ahead = scheme.weight.scale.group_size != 32 or scheme.weight.zero_point is None
        assert first.kernel is not None and first.kernel.name == ("cpu_gemv" if ahead else "tinygemm_cpu")
        assert first.candidate("tinygemm_cpu").accepted and first.candidate("cpu_gemv").accepted
    for dtype in ("float16", "float32"):
        candidate = _resolve(scheme, "cpu", dtype).candidate("tinygemm_cpu")
        assert not candidate.accepted and candidate.stage == "problem"
        assert f"takes bfloat16 activations; layer has {dtype}" in candidate.reason


@pytest.mark.parametrize("device", ["sm80", "sm86", "sm90", "sm100"])
@pytest.mark.parametrize("name", INT4_SCHEMES)
def test_cuda_8_0_and_newer_accept_tinygemm(device: str, name: str) -> None:
    resolution = _resolve(builtin_scheme(name), device)
    candidate = resolution.candidate("tinygemm")
    assert candidate.accepted, candidate.reason
    chosen = resolution.kernel
    assert chosen is not None and (chosen.name == "tinygemm" or chosen.priority > TINYGEMM.priority)
    assert resolution.candidate("tinygemm_cpu").reason == "runs on cpu; device is cuda"


def test_turing_and_cpu_only_torch_reject_tinygemm_with_their_reasons() -> None:
    scheme = builtin_scheme("compressed-tensors/W4A16")
    candidate = _resolve(scheme, "sm75").candidate("tinygemm")
    assert candidate.stage == "device" and "needs compute capability 8.0 or newer; device is 7.5" in candidate.reason
    facts = registry.complete_facts(simulated_device("sm90", torch_build="cpu"))
    candidate = _resolve(scheme, facts).candidate("tinygemm")
    assert candidate.stage == "device" and "CPU-only build" in candidate.reason


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_16_bit_float_and_fp32_activations_on_cuda_reject_tinygemm_with_the_dtype_reason(dtype: str) -> None:
    resolution = _resolve(builtin_scheme("compressed-tensors/W4A16"), "sm90", dtype)
    candidate = resolution.candidate("tinygemm")
    assert not candidate.accepted and candidate.stage == "problem"
    assert candidate.reason == f"takes bfloat16 activations; layer has {dtype}"
    assert candidate.hint == "cast the inputs to bfloat16"
    assert resolution.kernel is not None and resolution.kernel.name != "tinygemm"


@pytest.mark.parametrize("device", ["cpu", "sm90"])
def test_group_16_and_other_weight_families_are_rejected_with_reasons(device: str) -> None:
    name = "tinygemm_cpu" if device == "cpu" else "tinygemm"
    candidate = _resolve(parse_scheme_text(INT4_G16), device).candidate(name)
    assert candidate.stage == "scheme"
    assert candidate.reason == "takes int4 weight groups of 32/64/128/256; scheme has groups of 16"
    candidate = _resolve(builtin_scheme("compressed-tensors/NVFP4A16"), device).candidate(name)
    assert (
        candidate.stage == "scheme" and candidate.reason == "implements blocks, int4 weights; scheme has nvfp4 weights"
    )
    candidate = _resolve(builtin_scheme("compressed-tensors/W8A8"), device).candidate(name)
    assert (
        candidate.stage == "scheme" and candidate.reason == "implements blocks, int4 weights; scheme has int8 weights"
    )


def test_the_kernel_code_refuses_what_it_does_not_run() -> None:
    kernel = TinygemmCpuKernel()
    with pytest.raises(UsageError, match=r"group scales of 32/64/128/256 or channel scales; .* groups of 16"):
        kernel.prepare(random_weight(parse_scheme_text(INT4_G16), 16, 64), CPU)
    with pytest.raises(UsageError, match="runs int4 and uint4 weights"):
        kernel.prepare(random_weight(builtin_scheme("compressed-tensors/NVFP4A16"), 16, 64), CPU)
    with pytest.raises(UsageError, match="runs on cuda"):
        TinygemmKernel().prepare(random_weight(builtin_scheme("compressed-tensors/W4A16"), 16, 128), CPU)
    state = kernel.prepare(random_weight(builtin_scheme("compressed-tensors/W4A16"), 16, 128), CPU)
    with pytest.raises(UsageError, match=r"takes bfloat16 activations, not torch\.float32"):
        kernel.apply(state, torch.randn(2, 128), None)
    assert kernel.apply(state, torch.zeros(0, 128, dtype=BF16), None).shape == (0, 16)


# --- the weight tinygemm uses ----------------------------------------------------------------


@pytest.mark.parametrize(("name", "group"), [c for c in CLAIMED if "ASYM" not in c[0]])
def test_symmetric_weights_with_bfloat16_scales_are_the_reference_exactly(name: str, group: int) -> None:
    scheme = claimed_scheme(name, group)
    weight = random_weight(scheme, 48, storable_k(scheme, 2 * group + 40), scale_dtype="bfloat16", seed=group)
    reference = dequantize(weight)
    assert torch.equal(effective_weight_cpu(TinygemmCpuKernel(), weight), reference)
    # and through apply: an identity input gives each weight rounded once to bfloat16
    kernel = TinygemmCpuKernel()
    state = kernel.prepare(replace(weight, input_pre_scale=None), CPU)
    y = kernel.apply(state, torch.eye(weight.k, dtype=BF16), None)
    assert torch.equal(y.t(), reference.to(BF16))


def test_uint4_codes_without_zero_points_are_exact_too() -> None:
    weight = random_weight(parse_scheme_text(UINT4_SYMMETRIC_G64), 32, 200, seed=3)
    assert torch.equal(effective_weight_cpu(TinygemmCpuKernel(), weight), dequantize(weight))


@pytest.mark.parametrize("scale_dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize(
    "scheme", [*(claimed_scheme(n, 128) for n in INT4_SCHEMES), parse_scheme_text(UINT4_CHANNEL)], ids=lambda s: s.name
)
def test_the_effective_weight_is_within_the_stated_bound(scheme: Scheme, scale_dtype: str) -> None:
    weight = random_weight(scheme, 40, storable_k(scheme, 300), scale_dtype=scale_dtype, seed=11)
    actual = effective_weight_cpu(TinygemmCpuKernel(), weight).double()
    reference = dequantize(weight).double()
    bound = weight_bound(weight)
    assert float(((actual - reference).abs() - bound).max()) <= 0
    exact = scale_dtype == "bfloat16" and weight.zero_point is None
    assert torch.equal(actual, reference) == exact  # rounding happens exactly where the bound says
    scale = _columns(effective_scale(weight).double(), scheme, weight.k)
    assert float((bound / scale).max()) <= 0.1  # (8 + 16) * 2**-8 at most: under a tenth of a step


def test_round_once_rounds_float64_to_bfloat16_once() -> None:
    midpoint = 1 + 2.0**-8  # between 1 and 1 + 2**-7
    values = torch.tensor(
        [midpoint + 2.0**-30, midpoint - 2.0**-30, midpoint, 3 + 2.0**-7 + 2.0**-29, -(midpoint + 2.0**-30)],
        dtype=torch.float64,
    )
    assert values.to(BF16)[0] == 1.0  # torch's own cast rounds twice
    assert tk.round_once(values, BF16).tolist() == [1 + 2.0**-7, 1.0, 1.0, 3 + 2.0**-6, -(1 + 2.0**-7)]
    random = torch.randn(10_000, dtype=torch.float64) * torch.exp2(torch.randint(-20, 20, (10_000,)).double())
    rounded = tk.round_once(random, BF16).double()
    assert bool(((rounded - random).abs() <= half_ulp_bf16(random)).all())


# --- outputs against the reference ----------------------------------------------------------------


@pytest.mark.parametrize(("name", "group"), CLAIMED, ids=[f"{n}-g{g}" for n, g in CLAIMED])
def test_tinygemm_cpu_matches_the_reference(name: str, group: int) -> None:
    scheme = claimed_scheme(name, group)
    n, k = 50, storable_k(scheme, 2 * group + 72)  # ragged N (16) and K (the group)
    weight = random_weight(scheme, n, k, scale_dtype="bfloat16", seed=group + 1)
    kernel = TinygemmCpuKernel()
    state = kernel.prepare(weight, CPU)
    assert (state.padded_n, state.padded_k, state.group_size) == (64, -(-k // group) * group, group)
    generator = torch.Generator().manual_seed(group)
    bias = torch.randn(n, generator=generator)
    for shape, b in (((1, k), None), ((2, 3, k), bias), ((5, k), bias.to(BF16))):
        x = torch.randn(*shape, generator=generator).to(BF16)
        y = kernel.apply(state, x, b)
        expected, bound = expected_and_bound(weight, x.reshape(-1, k), b, CPU)
        assert_within(y.reshape(-1, n), expected, bound, f"{scheme.name} x{list(shape)} bias={b is not None}")


@pytest.mark.parametrize("scale_dtype", ["float16", "float32"])
@pytest.mark.parametrize(
    "scheme", [*(claimed_scheme(n, 128) for n in INT4_SCHEMES), parse_scheme_text(UINT4_CHANNEL)], ids=lambda s: s.name
)
def test_wider_scales_match_the_reference_within_their_rounding(scheme: Scheme, scale_dtype: str) -> None:
    weight = random_weight(scheme, 24, storable_k(scheme, 130), scale_dtype=scale_dtype, seed=5)
    kernel = TinygemmCpuKernel()
    x = torch.randn(3, weight.k, generator=torch.Generator().manual_seed(6)).to(BF16)
    expected, bound = expected_and_bound(weight, x, None, CPU)
    assert_within(kernel.apply(kernel.prepare(weight, CPU), x, None), expected, bound, f"{scheme.name} {scale_dtype}")


@pytest.mark.parametrize("name", INT4_SCHEMES)
def test_fused_partitions_with_different_scales_run_as_separate_layers(name: str) -> None:
    scheme = builtin_scheme(name)
    k = storable_k(scheme, 384)
    members = []
    shared = layer_tensors(scheme, n=32, k=k, seed=0)
    for seed, size, magnitude in ((0, 32, 1.0), (1, 16, 8.0), (2, 16, 0.125)):
        tensors = layer_tensors(scheme, n=size, k=k, seed=seed)
        scale = scheme.weight.scale.tensor.name
        tensors[scale] = tensors[scale] * magnitude  # partitions calibrated apart
        if scheme.input_pre_scale is not None:  # one input, one pre-scale
            tensors[scheme.input_pre_scale.name] = shared[scheme.input_pre_scale.name]
        members.append(canonicalize(scheme, tensors))
    fused = concatenate(members)
    assert fused.partitions == (32, 16, 16)
    kernel = TinygemmCpuKernel()
    x = (torch.randn(2, 3, k, generator=torch.Generator().manual_seed(4)) * 2).to(BF16)
    y = kernel.apply(kernel.prepare(fused, CPU), x, None)
    separate = torch.cat([kernel.apply(kernel.prepare(m, CPU), x, None) for m in members], dim=-1)
    assert torch.equal(y, separate)  # the same bits: a partition's output depends on its rows alone
    expected, bound = expected_and_bound(fused, x.reshape(-1, k), None, CPU)
    assert_within(y.reshape(-1, fused.n), expected, bound, f"{name} fused")


def test_the_awq_pre_scale_multiplies_the_input_first() -> None:
    scheme = builtin_scheme("modelopt/W4A16_AWQ")
    weight = canonicalize(scheme, layer_tensors(scheme, n=64, k=256, seed=9))
    assert weight.input_pre_scale is not None
    kernel = TinygemmCpuKernel()
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3)).to(BF16)
    y = kernel.apply(kernel.prepare(weight, CPU), x, None)
    without = kernel.apply(kernel.prepare(replace(weight, input_pre_scale=None), CPU), x, None)
    expected, bound = expected_and_bound(weight, x, None, CPU)
    assert_within(y, expected, bound, "AWQ with pre_quant_scale")
    assert float((y.double() - without.double()).abs().max()) > 5 * float(bound.max())


def test_a_quant_linear_on_the_cpu_runs_tinygemm_cpu() -> None:
    scheme = builtin_scheme("compressed-tensors/W4A16_ASYM")
    tensors = layer_tensors(scheme, n=48, k=200, seed=2)
    bias = torch.randn(48)
    layer = QuantLinear.from_tensors(scheme, tensors, bias=bias, kernel="tinygemm_cpu")
    assert layer.kernel.name == "tinygemm_cpu"
    x = torch.randn(2, 5, 200, generator=torch.Generator().manual_seed(1)).to(BF16)
    y = layer(x)
    expected, bound = expected_and_bound(layer.weight_canonical, x.reshape(-1, 200), bias, CPU)
    assert_within(y.reshape(-1, 48), expected, bound, "QuantLinear")


# --- packing and memory -------------------------------------------------------------------------


def test_cpu_packing_in_slabs_equals_packing_the_whole_matrix(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = random_weight(builtin_scheme("compressed-tensors/W4A16"), 200, 96, seed=1)  # N pads to 208
    monkeypatch.setattr(tk, "CPU_PACKING_SLAB_ROWS", 64)
    state = TinygemmCpuKernel().prepare(weight, CPU)
    values = torch.full((208, 128), 8, dtype=torch.int32)
    values[:200] = tk.unsigned_values(weight, slice(0, 200), 128)
    assert torch.equal(state.packed, torch._convert_weight_to_int4pack_for_cpu(values, 2))
    assert torch.equal(values[:200, :96], (element_values(weight) + 8).to(torch.int32))  # u = q + 8
    assert bool((values[:, 96:] == 8).all()) and bool((values[200:] == 8).all())


@pytest.mark.parametrize("name", ["compressed-tensors/W4A16", "compressed-tensors/W4A16_ASYM"])
def test_cuda_bytes_hold_element_2j_in_the_high_nibble(name: str) -> None:
    weight = random_weight(builtin_scheme(name), 20, 131, seed=8)  # odd K, ragged N
    raw = tk.cuda_bytes(weight, 24, 256, CPU)
    assert raw.shape == (24, 128) and raw.dtype == torch.uint8
    unpacked = torch.stack((raw >> 4, raw & 0xF), dim=-1).reshape(24, 256).to(torch.int32)
    values = torch.full((24, 256), 8, dtype=torch.int32)
    values[:20] = tk.unsigned_values(weight, slice(0, 20), 256)
    assert torch.equal(unpacked, values)
    assert [TinygemmKernel.inner_k_tiles(k) for k in (32, 64, 96, 128, 256, 384)] == [2, 4, 2, 8, 8, 8]
    meta = torch._convert_weight_to_int4pack(raw.to("meta"), TinygemmKernel.inner_k_tiles(256))
    assert meta.shape == (3, 2, 32, 4)  # [N/8, K/(8*16), 32, 8/2]: the layout _weight_int4pack_mm reads


def _storages(tensors: list[Tensor]) -> int:
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def test_a_layer_keeps_the_4_bit_weight_twice_and_its_scales_three_times() -> None:
    n, k, group = 512, 1024, 128
    weight = random_weight(builtin_scheme("compressed-tensors/W4A16"), n, k, scale_dtype="bfloat16")
    layer = QuantLinear.from_canonical(weight, kernel="tinygemm_cpu")
    assert layer.kernel.name == "tinygemm_cpu"
    layer(torch.randn(1, k).to(BF16))
    state = layer._states[("bfloat16", "tinygemm_cpu")]  # per (dtype, kernel of the plan)
    four_bit = _storages([b for name, b in layer.named_buffers() if name.startswith("canonical_")])
    assert four_bit == n * k // 2 + n * (k // group) * 2
    kept = _storages([*layer.buffers(), state.packed, state.scales_and_zeros])
    assert _storages([state.packed, state.scales_and_zeros]) == n * k // 2 + (k // group) * n * 2 * 2
    assert kept == 2 * four_bit + n * (k // group) * 2  # 2.0303x: scales_and_zeros doubles the scales
    assert 2.03 < kept / four_bit < 2.031


def test_the_pre_scale_is_shared_with_the_canonical_tensor_when_already_float32() -> None:
    scheme = builtin_scheme("modelopt/W4A16_AWQ")
    weight = random_weight(scheme, 16, 128)
    assert weight.input_pre_scale is not None and weight.input_pre_scale.dtype == torch.float32
    state = TinygemmCpuKernel().prepare(weight, CPU)
    assert state.pre_scale is weight.input_pre_scale


# --- CUDA ----------------------------------------------------------------------------------------

needs_sm80 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
    reason="needs a CUDA GPU of compute capability 8.0 or newer",
)


# the CUDA check's cases: every claimed form, and issue 27's GPTQ/AWQ int4 schemes of groups of 128
CUDA_CASES = CLAIMED + [(name, 128) for name in ("gptq/W4A16", "gptq/W4A16_ASYM", "gptq_v2/W4A16", "awq/W4A16_ASYM")]


def used_on_cuda(kernel: TinygemmKernel, state: tk.TinygemmState, weight: CanonicalWeight) -> Tensor:
    """The [N, K] weight the CUDA op uses, checked against the reference's within ``weight_bound``.

    An identity input returns each of its (bfloat16) weights exactly. The outputs are then held
    to that weight's GEMM bound: summed over K = 4096, the bfloat16 rounding of each weight that
    ``weight_bound`` allows for adds up to more than 5% of the output (a bound too loose to
    mean anything), while what the op does is measured by its own weights."""
    n, k = weight.n, weight.k
    eye = torch.eye(state.padded_k, dtype=BF16, device=state.packed.device)
    used = kernel.matmul(eye, state.packed, state.group_size, state.scales_and_zeros).t()[:n, :k].cpu()
    excess = (used.double() - dequantize(weight).double()).abs() - weight_bound(weight, cuda=True)
    assert float(excess.max()) <= 0, f"{weight.scheme.name} {n}x{k}: weight off by {float(excess.max()):.3e} too much"
    return used


@pytest.mark.gpu
@needs_sm80
@pytest.mark.parametrize(("name", "group"), CUDA_CASES, ids=[f"{n}-g{g}" for n, g in CUDA_CASES])
def test_tinygemm_on_cuda_matches_the_reference(name: str, group: int) -> None:
    scheme = claimed_scheme(name, group)
    device = torch.device("cuda")
    kernel = TinygemmKernel()
    for n, k, scale_dtype in ((50, storable_k(scheme, 2 * group + 72), "bfloat16"), (4096, 4096, "float32")):
        weight = random_weight(scheme, n, k, scale_dtype=scale_dtype, seed=group)
        state = kernel.prepare(weight, device)
        used = used_on_cuda(kernel, state, weight)
        generator = torch.Generator().manual_seed(n)
        bias = torch.randn(n, generator=generator)
        for shape, b in (((1, k), None), ((3, 5, k), bias), ((37, k), bias.to(BF16))):
            x = torch.randn(*shape, generator=generator).to(BF16)
            y = kernel.apply(state, x.to(device), None if b is None else b.to(device))
            assert y.device.type == "cuda"
            expected, bound = expected_and_bound(weight, x.reshape(-1, k), b, device, used=used)
            assert_within(y.reshape(-1, n), expected, bound, f"{scheme.name} {n}x{k} x{list(shape)}")


@pytest.mark.gpu
@needs_sm80
def test_tinygemm_on_cuda_runs_uint4_channel_scales_fused_layers_and_pre_scales() -> None:
    device = torch.device("cuda")
    kernel = TinygemmKernel()
    channel = random_weight(parse_scheme_text(UINT4_CHANNEL), 40, 300, seed=2)
    awq = builtin_scheme("modelopt/W4A16_AWQ")
    first, second = layer_tensors(awq, n=32, k=256, seed=0), layer_tensors(awq, n=16, k=256, seed=1)
    second["weight_scale"] = second["weight_scale"] * 4
    second["pre_quant_scale"] = first["pre_quant_scale"]
    members = [canonicalize(awq, first), canonicalize(awq, second)]
    for weight in (channel, concatenate(members)):
        x = torch.randn(3, weight.k, generator=torch.Generator().manual_seed(7)).to(BF16)
        state = kernel.prepare(weight, device)
        y = kernel.apply(state, x.to(device), None)
        expected, bound = expected_and_bound(weight, x, None, device, used=used_on_cuda(kernel, state, weight))
        assert_within(y, expected, bound, weight.scheme.name)


@pytest.mark.gpu
@needs_sm80
def test_a_quant_linear_on_cuda_runs_tinygemm() -> None:
    scheme = builtin_scheme("compressed-tensors/W4A16")
    layer = QuantLinear.from_tensors(scheme, layer_tensors(scheme, n=256, k=512), device="cuda")
    assert layer.kernel.name == "tinygemm" or layer.kernel.priority > TINYGEMM.priority
    layer = QuantLinear.from_tensors(scheme, layer_tensors(scheme, n=256, k=512), device="cuda", kernel="tinygemm")
    x = torch.randn(4, 512).to(BF16)
    expected, bound = expected_and_bound(layer.weight_canonical, x, None, torch.device("cuda"), cuda=True)
    assert_within(layer(x.cuda()), expected, bound, "QuantLinear on cuda")
