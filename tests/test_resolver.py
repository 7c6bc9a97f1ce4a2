"""The pure resolver over schemes x simulated devices, with fake device facts (no GPU, no plugins)."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
from kernel_fakes import (
    ALL_FEATURES,
    AS_IF_IMPLEMENTED,
    BUILTIN_DECLARATIONS,
    E5M2_PER_TOKEN,
    STRICT_MARLIN,
    STRICT_MARLIN_SET,
    all_modules,
    builtin_scheme,
    fake_device,
    implemented,
)
from qscheme_plugins.marlin import MARLIN
from qscheme_plugins.reference import REFERENCE
from qscheme_plugins.triton_declaration import TRITON

from qscheme import int8_gemm
from qscheme.descriptor import Scheme, parse_scheme_file
from qscheme.errors import NoKernelError, UsageError
from qscheme.kernels.declaration import (
    ANY_DEVICE,
    WEIGHT_ONLY,
    ActivationSupport,
    CheckResult,
    DeviceSupport,
    KernelDeclaration,
    Supports,
)
from qscheme.kernels.problem import Problem, normalize_dtype
from qscheme.kernels.render import activation_pairings, no_kernel_message
from qscheme.kernels.resolver import Candidate, Resolver, resolve

SQUARE = Problem(4096, 4096)
INTERPRETED = (("TRITON_INTERPRET", "1"),)
NO_VLLM = all_modules() - {"vllm"}


def reasons_at(candidate: Candidate, stage: str) -> str:
    """The candidate's failing checks at one stage, joined as ``Candidate.reason`` joins them all."""
    return "; ".join(f.reason for f in candidate.failures if f.stage == stage)


# (scheme, device, expected kernel) with every built-in kernel as if its code were installed, and
# bf16 activations. Priorities: native_fp4 / native_mxfp4 100, native_fp8* 90, marlin 80, tinygemm 70,
# cpu_gemv for int4 62, tinygemm_cpu 60, triton 50, cpu_gemv 45, reference 0, native_fp8_cpu -10.
EXPECTED: list[tuple[str, str, str | None]] = [
    # W4A4 NVFP4: native FP4 on both Blackwell families, Triton elsewhere on CUDA 8.0+.
    ("compressed-tensors/NVFP4", "sm100", "native_fp4"),
    ("compressed-tensors/NVFP4", "sm103", "native_fp4"),
    ("compressed-tensors/NVFP4", "sm120", "native_fp4"),
    ("compressed-tensors/NVFP4", "sm90", "triton"),
    ("compressed-tensors/NVFP4", "sm89", "triton"),
    ("compressed-tensors/NVFP4", "sm80", "triton"),
    ("compressed-tensors/NVFP4", "cpu", "cpu_gemv"),
    ("modelopt/NVFP4", "sm100", "native_fp4"),
    ("modelopt/NVFP4", "sm90", "triton"),
    ("modelopt/NVFP4_AWQ", "sm100", "native_fp4"),  # native_fp4 applies the AWQ pre-scale itself
    # W4A16: Marlin wherever CUDA 8.0+ (native FP4 needs FP4 activations; tinygemm ranks below Marlin).
    ("compressed-tensors/NVFP4A16", "sm100", "marlin"),
    ("compressed-tensors/NVFP4A16", "sm80", "marlin"),
    ("modelopt/W4A16_NVFP4", "sm120", "marlin"),
    ("compressed-tensors/MXFP4A16", "sm90", "marlin_mxfp4"),  # MXFP4 Marlin: bf16 only, declared apart
    ("compressed-tensors/W4A16", "sm86", "marlin"),
    ("compressed-tensors/W4A16_ASYM", "sm90", "marlin"),
    ("compressed-tensors/NVFP4A16", "cpu", "cpu_gemv"),
    # int4 weight-only on a CPU: cpu_gemv, whose int4 entry (62) ranks above torch's tinygemm for CPUs (60).
    ("compressed-tensors/W4A16", "cpu", "cpu_gemv"),
    ("compressed-tensors/W4A16_ASYM", "cpu", "cpu_gemv"),
    ("modelopt/W4A16_AWQ", "cpu", "cpu_gemv"),
    ("modelopt/fp8_pb_wo", "sm90", "marlin"),  # Marlin runs 128x128 fp8 blocks as groups of 128
    # MXFP4 W4A4: native on datacenter Blackwell (10.x) only, else Triton quantizes the activations itself.
    ("compressed-tensors/MXFP4", "sm100", "native_mxfp4"),
    ("compressed-tensors/MXFP4", "sm103", "native_mxfp4"),
    ("compressed-tensors/MXFP4", "sm120", "triton"),
    ("compressed-tensors/MXFP4", "sm90", "triton"),
    ("compressed-tensors/MXFP4", "cpu", "cpu_gemv"),
    ("modelopt/mxfp4", "sm100", "native_mxfp4"),
    ("modelopt/mxfp4", "sm120", "triton"),
    # FP8 W8A8: tensor-wise native FP8 from 8.9; row-wise on 8.9, 9.x and 10.0-10.3; block-wise on 9.0 only;
    # Triton elsewhere on CUDA 8.0+; on a CPU the reference (native_fp8_cpu ranks below it).
    ("compressed-tensors/FP8", "sm80", "triton"),
    ("compressed-tensors/FP8", "sm89", "native_fp8"),
    ("compressed-tensors/FP8", "sm90", "native_fp8"),
    ("compressed-tensors/FP8", "sm120", "native_fp8"),
    ("compressed-tensors/FP8", "cpu", "cpu_gemv"),
    ("compressed-tensors/FP8_DYNAMIC", "sm89", "native_fp8_rowwise"),
    ("compressed-tensors/FP8_DYNAMIC", "sm100", "native_fp8_rowwise"),
    ("compressed-tensors/FP8_DYNAMIC", "sm120", "triton"),
    ("compressed-tensors/FP8_DYNAMIC", "cpu", "cpu_gemv"),
    ("compressed-tensors/FP8_BLOCK", "sm90", "native_fp8_block"),
    ("compressed-tensors/FP8_BLOCK", "sm100", "triton"),
    ("compressed-tensors/FP8_BLOCK", "sm89", "triton"),
    ("modelopt/FP8", "sm90", "native_fp8"),
    # int8 W8A8: Triton on CUDA 8.0+; on a CPU cpu_int8_gemm where this CPU has AVX512-VNNI (its check
    # reads the machine), else cpu_gemv.
    ("compressed-tensors/W8A8", "sm80", "triton"),
    ("compressed-tensors/W8A8", "sm120", "triton"),
    ("compressed-tensors/W8A8", "cpu", "cpu_int8_gemm" if int8_gemm.supported_isa() == "vnni" else "cpu_gemv"),
    # AWQ with an always-present pre-scale would exclude Marlin; its pre-scale is optional.
    ("modelopt/W4A16_AWQ", "sm90", "marlin"),
    # Turing (sm75, T4-class): the reference only. Marlin, Triton and tinygemm need 8.0 (vLLM 0.33's
    # Turing Marlin runs float16 activations only, which Marlin's declaration does not claim), native FP8 8.9.
    ("compressed-tensors/NVFP4A16", "sm75", "reference"),
    ("compressed-tensors/W4A16", "sm75", "reference"),
    ("modelopt/fp8_pb_wo", "sm75", "reference"),
    ("compressed-tensors/NVFP4", "sm75", "reference"),
    ("compressed-tensors/FP8_DYNAMIC", "sm75", "reference"),
    ("compressed-tensors/FP8", "sm75", "reference"),
    # NVFP4 weights with FP8 inputs: no kernel, anywhere.
    ("modelopt/W4A8_NVFP4_FP8", "sm100", None),
    ("modelopt/W4A8_NVFP4_FP8", "sm90", None),
    ("modelopt/W4A8_NVFP4_FP8", "cpu", None),
]


@pytest.mark.parametrize(("scheme_name", "device_name", "expected"), EXPECTED)
def test_expected_kernel(scheme_name: str, device_name: str, expected: str | None) -> None:
    resolution = resolve(builtin_scheme(scheme_name), SQUARE, fake_device(device_name), AS_IF_IMPLEMENTED)
    chosen = resolution.kernel.name if resolution.kernel else None
    assert chosen == expected, no_kernel_message(resolution) if chosen is None else resolution.trace
    assert len(resolution.trace) == len(AS_IF_IMPLEMENTED)
    assert sum(c.chosen for c in resolution.trace) == (expected is not None)


@pytest.mark.parametrize(
    ("scheme_name", "device_name", "expected"),
    [
        ("compressed-tensors/W4A16", "sm80", "tinygemm"),
        ("compressed-tensors/W4A16_ASYM", "sm90", "tinygemm"),
        ("modelopt/W4A16_AWQ", "sm120", "tinygemm"),
        ("compressed-tensors/W4A16", "sm75", "reference"),  # tinygemm needs 8.0
        ("compressed-tensors/NVFP4A16", "sm90", "triton"),  # tinygemm is int4 only
    ],
)
def test_without_vllm_int4_weight_only_layers_go_to_tinygemm(scheme_name: str, device_name: str, expected: str) -> None:
    resolution = resolve(
        builtin_scheme(scheme_name), SQUARE, fake_device(device_name, modules=NO_VLLM), AS_IF_IMPLEMENTED
    )
    assert resolution.kernel is not None and resolution.kernel.name == expected, resolution.trace
    assert "needs module vllm" in resolution.candidate("marlin").reason


def test_tinygemm_takes_bf16_activations_only() -> None:
    scheme = builtin_scheme("compressed-tensors/W4A16")
    for dtype in ("fp16", "fp32"):
        on_cpu = resolve(scheme, Problem(4096, 4096, dtype), fake_device("cpu"), AS_IF_IMPLEMENTED)
        assert on_cpu.kernel is not None and on_cpu.kernel.name == "cpu_gemv"  # it takes 16- and 32-bit inputs
        cpu = on_cpu.candidate("tinygemm_cpu")
        assert (cpu.stage, cpu.reason) == ("problem", f"takes bfloat16 activations; layer has {normalize_dtype(dtype)}")
        on_gpu = resolve(scheme, Problem(4096, 4096, dtype), fake_device("sm90", modules=NO_VLLM), AS_IF_IMPLEMENTED)
        assert on_gpu.kernel is not None and on_gpu.kernel.name == "triton"
        assert on_gpu.candidate("tinygemm").stage == "problem"


def test_triton_on_cpu_needs_the_interpreter() -> None:
    scheme = builtin_scheme("compressed-tensors/W4A16")
    # cpu_gemv (62 for int4) and tinygemm_cpu (60) outrank triton (50) for int4 on a CPU: leave them
    # out here
    without_tinygemm = {"tinygemm_cpu", "cpu_gemv"}
    plain = resolve(scheme, SQUARE, fake_device("cpu"), AS_IF_IMPLEMENTED, disabled=without_tinygemm)
    assert plain.kernel is not None and plain.kernel.name == "reference"
    triton = plain.candidate("triton")
    assert (triton.stage, triton.reason) == ("device", "on cpu needs TRITON_INTERPRET=1 (unset)")
    interpreted = resolve(
        scheme, SQUARE, fake_device("cpu", environment=INTERPRETED), AS_IF_IMPLEMENTED, disabled=without_tinygemm
    )
    assert interpreted.kernel is not None and interpreted.kernel.name == "triton"
    rocm = resolve(scheme, SQUARE, fake_device("rocm"), AS_IF_IMPLEMENTED)
    assert rocm.kernel is not None and rocm.kernel.name == "triton"


def test_capability_families_are_ranges_not_minimums() -> None:
    scheme = builtin_scheme("compressed-tensors/NVFP4")
    for name, accepted in [("sm90", False), ("sm100", True), ("sm103", True), ("sm120", True), ("sm89", False)]:
        native = resolve(scheme, SQUARE, fake_device(name), AS_IF_IMPLEMENTED).candidate("native_fp4")
        assert native.accepted is accepted, (name, native)
    beyond = replace(fake_device("sm120"), capability=(11, 0))
    native = resolve(scheme, SQUARE, beyond, AS_IF_IMPLEMENTED).candidate("native_fp4")
    assert native.reason == "needs compute capability 10.0-10.3 or 12.0-12.1; device is 11.0"
    hopper = resolve(scheme, SQUARE, fake_device("sm90"), AS_IF_IMPLEMENTED).candidate("native_fp4")
    assert (hopper.stage, hopper.reason) == ("device", "needs compute capability 10.0-10.3 or 12.0-12.1; device is 9.0")


def test_turing_is_simulated_and_judged_by_capability() -> None:
    resolution = resolve(builtin_scheme("compressed-tensors/NVFP4"), SQUARE, fake_device("sm75"), AS_IF_IMPLEMENTED)
    assert (
        reasons_at(resolution.candidate("triton"), "device") == "needs compute capability 8.0 or newer; device is 7.5"
    )
    assert "device is 7.5" in reasons_at(resolution.candidate("native_fp4"), "device")


def test_marlin_reasons_say_compute_capability() -> None:
    for capability in ((7, 0), (7, 5)):
        older = replace(fake_device("sm80"), capability=capability)
        scheme = builtin_scheme("compressed-tensors/W4A16")
        marlin = resolve(scheme, SQUARE, older, AS_IF_IMPLEMENTED).candidate("marlin")
        assert marlin.reason == f"needs compute capability 8.0 or newer; device is {capability[0]}.{capability[1]}"
        assert "CUDA>=" not in marlin.reason


def test_problem_stage_alignment_dtype_and_partitions() -> None:
    scheme = builtin_scheme("compressed-tensors/NVFP4A16")
    device = fake_device("sm90")
    ragged = resolve(scheme, Problem(4096, 4000), device, STRICT_MARLIN_SET)
    strict = ragged.candidate("strict_marlin")
    assert strict.stage == "problem"
    assert strict.reason == (
        "needs N % 64 == 0 and K % 128 == 0, or N % 128 == 0 and K % 64 == 0; layer has N=4096, K=4000"
    )
    assert strict.hint == "pad the layer to N=4096, K=4096"
    assert ragged.kernel is not None and ragged.kernel.name == "triton"
    # The real Marlin pads N and K to its tiles (as vLLM 0.33 does): any shape is taken.
    padded = resolve(scheme, Problem(4096, 4000), device, AS_IF_IMPLEMENTED)
    assert padded.candidate("marlin").failures == ()
    assert padded.kernel is not None and padded.kernel.name == "marlin"

    fp32 = resolve(scheme, Problem(4096, 4096, "fp32"), device, AS_IF_IMPLEMENTED)
    assert fp32.candidate("marlin").stage == "problem"
    assert fp32.candidate("marlin").reason == "takes bfloat16 or float16 activations; layer has float32"
    assert fp32.candidate("marlin").hint == "cast the inputs to bfloat16"
    assert fp32.kernel is not None and fp32.kernel.name == "triton"

    fused = Problem(6144, 4096, partitions=3, partition_scales_differ=True, layer="model.layers.0.self_attn.qkv_proj")
    resolution = resolve(scheme, fused, device, STRICT_MARLIN_SET)
    assert resolution.candidate("strict_marlin").reason == (
        "takes one global scale per layer; its 3 fused partitions have different scales"
    )
    assert resolution.kernel is not None and resolution.kernel.name == "triton"
    equal = resolve(scheme, replace(fused, partition_scales_differ=False), device, STRICT_MARLIN_SET)
    assert equal.kernel is not None and equal.kernel.name == "strict_marlin"
    # The real Marlin runs fused partitions with different global scales one GEMM each.
    per_partition = resolve(scheme, fused, device, AS_IF_IMPLEMENTED)
    assert per_partition.kernel is not None and per_partition.kernel.name == "marlin"


def test_input_pre_scale_is_a_problem_fact() -> None:
    scheme = builtin_scheme("modelopt/W4A16_AWQ")
    problem = Problem(4096, 4096, input_pre_scale=True)
    with_pre_scale = resolve(scheme, problem, fake_device("sm90"), STRICT_MARLIN_SET)
    assert with_pre_scale.candidate("strict_marlin").stage == "problem"
    assert "pre-scale" in with_pre_scale.candidate("strict_marlin").reason
    # tinygemm declares input_pre_scale (it multiplies the input itself) and ranks next after Marlin
    assert with_pre_scale.kernel is not None and with_pre_scale.kernel.name == "tinygemm"
    # The real Marlin declares it too (it multiplies the input in the activation dtype).
    marlin = resolve(scheme, problem, fake_device("sm90"), AS_IF_IMPLEMENTED)
    assert marlin.kernel is not None and marlin.kernel.name == "marlin"
    assert resolve(scheme, Problem(4096, 4096), fake_device("sm90"), STRICT_MARLIN_SET).kernel == STRICT_MARLIN


def test_missing_library_and_implementation_are_device_stage() -> None:
    scheme = builtin_scheme("compressed-tensors/W4A16")
    no_vllm = resolve(scheme, SQUARE, fake_device("sm90", modules=NO_VLLM), AS_IF_IMPLEMENTED)
    assert no_vllm.candidate("marlin").reason == (
        "needs module vllm, not importable here (optional kernel libraries are checked in the local environment)"
    )
    # A declared-only kernel (no implementation) is rejected at the device stage; no built-in is one.
    assert all(d.implementation for d in BUILTIN_DECLARATIONS)
    declared_only_marlin = replace(MARLIN, name="declared_marlin", implementation=None, plugin="declared_marlin")
    declared_only = resolve(scheme, SQUARE, fake_device("sm90"), (*BUILTIN_DECLARATIONS, declared_only_marlin))
    assert (declared_only.candidate("declared_marlin").stage, declared_only.candidate("declared_marlin").reason) == (
        "device",
        "declared only: no implementation is installed",
    )
    assert declared_only.kernel is not None and declared_only.kernel.name == "marlin"
    # vLLM importable but not at the release whose ops Marlin calls (package metadata, not imported).
    for installed, reason in (
        ((("vllm", "0.32.1"),), "needs vllm >=0.33,<0.34; vllm 0.32.1 is installed"),
        ((), "needs vllm >=0.33,<0.34; no installed vllm distribution was found"),
    ):
        other = resolve(scheme, SQUARE, replace(fake_device("sm90"), distributions=installed), AS_IF_IMPLEMENTED)
        assert (other.candidate("marlin").stage, other.candidate("marlin").reason) == ("device", reason)
        assert other.kernel is not None and other.kernel.name == "tinygemm"
    no_triton_code = resolve(
        scheme,
        SQUARE,
        fake_device("sm90", modules=all_modules() - {"qscheme_plugins.triton_kernel"}),
        AS_IF_IMPLEMENTED,
    )
    assert no_triton_code.candidate("triton").reason == (
        "implementation qscheme_plugins.triton_kernel:TritonKernel is not importable here"
    )
    failed = resolve(
        scheme, SQUARE, fake_device("sm90"), AS_IF_IMPLEMENTED, unavailable={"triton": "ImportError: boom"}
    )
    assert failed.candidate("triton").reason == (
        "implementation qscheme_plugins.triton_kernel:TritonKernel failed to load: ImportError: boom"
    )
    no_fp4_dtype = resolve(
        builtin_scheme("compressed-tensors/NVFP4"),
        SQUARE,
        fake_device("sm100", features=frozenset({"_scaled_mm"})),
        AS_IF_IMPLEMENTED,
    )
    assert no_fp4_dtype.candidate("native_fp4").reason == (
        "needs torch.float4_e2m1fn_x2, torch.float8_e4m3fn, torch.nn.functional.scaled_mm, "
        "torch.nn.functional.ScalingType.BlockWise1x16, torch.nn.functional.ScalingType.TensorWise, "
        "torch.nn.functional.SwizzleType.SWIZZLE_32_4_4, which torch 2.13.0 lacks"
    )
    no_int4pack = resolve(
        scheme,
        SQUARE,
        fake_device("cpu", features=ALL_FEATURES - {"ops.aten._weight_int4pack_mm_for_cpu"}),
        AS_IF_IMPLEMENTED,
    )
    assert no_int4pack.candidate("tinygemm_cpu").reason == (
        "needs torch.ops.aten._weight_int4pack_mm_for_cpu, which torch 2.13.0 lacks"
    )
    assert no_int4pack.kernel is not None and no_int4pack.kernel.name == "cpu_gemv"


def test_order_is_priority_then_name_whatever_the_input_order() -> None:
    twins = [
        KernelDeclaration("b_twin", "test", 65, (Supports(("int4",)),), (DeviceSupport(ANY_DEVICE),), "fake_kernels:x"),
        KernelDeclaration("a_twin", "test", 65, (Supports(("int4",)),), (DeviceSupport(ANY_DEVICE),), "fake_kernels:x"),
    ]
    declarations = [*AS_IF_IMPLEMENTED, *twins]
    scheme = builtin_scheme("compressed-tensors/W4A16")
    first = resolve(scheme, SQUARE, fake_device("cpu"), declarations)
    names = [c.kernel for c in first.trace]
    assert names == [
        "native_fp4",
        "native_mxfp4",
        "native_fp8",
        "native_fp8_block",
        "native_fp8_rowwise",
        "marlin",
        "marlin_mxfp4",
        "tinygemm",
        "a_twin",
        "b_twin",
        "cpu_int8_gemm",
        "cpu_gemm_blocks",
        "cpu_gemv",  # 62: its int4 entry's priority
        "cpu_gemv_blocks_bf16",
        "tinygemm_cpu",
        "cpu_gemv_blocks",
        "dequant_gemm",
        "triton",
        "reference",
        "native_fp8_cpu",
    ]
    assert first.kernel is not None and first.kernel.name == "a_twin"
    assert first.candidate("b_twin").reason == "not chosen: a_twin ranks higher"
    assert first.candidate("tinygemm_cpu").reason == "not chosen: a_twin ranks higher"
    assert first.candidate("cpu_gemv").priority == 62 and first.candidate("cpu_gemv_blocks").priority == 56
    for seed in range(5):
        shuffled = list(declarations)
        random.Random(seed).shuffle(shuffled)
        again = resolve(scheme, SQUARE, fake_device("cpu"), shuffled)
        assert again.trace == first.trace and again.kernel == first.kernel


def test_a_supports_entry_ranks_its_kernel_for_the_schemes_it_takes() -> None:
    """An entry's own priority applies to the schemes that entry takes (the highest of the
    matching entries'), both in the order of the trace and in the choice; other schemes keep
    the kernel's priority."""
    anywhere = (DeviceSupport(ANY_DEVICE),)
    plain = Supports(("int4",), granularities=("group",), priority=75)  # no zero points
    general = Supports(("int4",), granularities=("group",), zero_points=True)
    ranked = KernelDeclaration("ranked", "test", 20, (general, plain), anywhere, "fake_kernels:x")
    rival = KernelDeclaration("rival", "test", 40, (general,), anywhere, "fake_kernels:x")
    assert ranked.priority_for(()) == 20 and ranked.priority_for((general,)) == 20
    assert ranked.priority_for((general, plain)) == 75
    symmetric = resolve(builtin_scheme("compressed-tensors/W4A16"), SQUARE, fake_device("cpu"), [rival, ranked])
    assert symmetric.kernel is not None and symmetric.kernel.name == "ranked"
    assert [(c.kernel, c.priority) for c in symmetric.trace] == [("ranked", 75), ("rival", 40)]
    assert symmetric.candidate("rival").reason == "not chosen: ranked ranks higher"
    # zero points: only the general entry takes the scheme, so the kernel's own priority holds
    asymmetric = resolve(builtin_scheme("compressed-tensors/W4A16_ASYM"), SQUARE, fake_device("cpu"), [ranked, rival])
    assert asymmetric.kernel is not None and asymmetric.kernel.name == "rival"
    assert [(c.kernel, c.priority) for c in asymmetric.trace] == [("rival", 40), ("ranked", 20)]
    # a rejected kernel shows its own priority
    nvfp4 = resolve(builtin_scheme("compressed-tensors/NVFP4A16"), SQUARE, fake_device("cpu"), [ranked, rival])
    assert nvfp4.kernel is None and [(c.kernel, c.priority) for c in nvfp4.trace] == [("rival", 40), ("ranked", 20)]
    assert "[priority 75]" in plain.describe() and "priority" not in general.describe()
    with pytest.raises(ValueError, match="priority must be an int or None"):
        Supports(("int4",), priority=True)  # type: ignore[arg-type]


def test_forcing_and_disabling() -> None:
    scheme = builtin_scheme("compressed-tensors/W4A16")
    device = fake_device("sm90")
    forced = resolve(scheme, SQUARE, device, AS_IF_IMPLEMENTED, force="reference")
    assert forced.kernel is not None and forced.kernel.name == "reference"
    assert forced.candidate("marlin").reason == "not chosen: kernel 'reference' is forced"

    cannot = resolve(scheme, SQUARE, fake_device("cpu"), AS_IF_IMPLEMENTED, force="marlin")
    assert cannot.kernel is None and cannot.forced == "marlin"
    with pytest.raises(NoKernelError, match="forced kernel 'marlin' cannot run"):
        cannot.require()

    with pytest.raises(UsageError, match=r"unknown kernel 'marlinn' was forced\. Did you mean 'marlin'"):
        resolve(scheme, SQUARE, device, AS_IF_IMPLEMENTED, force="marlinn")

    disabled = resolve(scheme, SQUARE, device, AS_IF_IMPLEMENTED, disabled={"marlin", "triton"})
    assert disabled.kernel is not None and disabled.kernel.name == "tinygemm"  # the next by priority
    assert disabled.candidate("marlin").stage == "disabled"
    all_three = resolve(scheme, SQUARE, device, AS_IF_IMPLEMENTED, disabled={"marlin", "tinygemm", "triton"})
    assert all_three.kernel is not None and all_three.kernel.name == "reference"
    assert {all_three.candidate(name).stage for name in ("marlin", "tinygemm", "triton")} == {"disabled"}


def test_memoising_resolver_shares_resolutions_across_layer_names() -> None:
    resolver = Resolver(fake_device("sm90"), AS_IF_IMPLEMENTED)
    scheme = builtin_scheme("compressed-tensors/W4A16")
    first = resolver.resolve(scheme, Problem(4096, 4096, layer="layers.0.q_proj"))
    second = resolver.resolve(scheme, Problem(4096, 4096, layer="layers.1.q_proj"))
    assert first.trace is second.trace and first.kernel == second.kernel
    assert second.problem.layer == "layers.1.q_proj"
    assert resolver.resolve(scheme, Problem(4096, 4096, layer="layers.0.q_proj")) is first


NVFP4_WEIGHTS_FP8_INPUTS = """\
name: test/ct-nvfp4-weights-fp8-inputs
producer: compressed-tensors
description: a compressed-tensors config pairing NVFP4 weights with static FP8 input_activations
weight:
  format: e2m1
  packing: nibbles_k
  tensor: {name: weight_packed, dtype: uint8, shape: [N, K/2]}
  scale:
    granularity: group
    group_size: 16
    format: e4m3
    stored: multiplier
    tensor: {name: weight_scale, dtype: float8_e4m3fn, shape: [N, K/16]}
  global_scale:
    stored: reciprocal
    tensor: {name: weight_global_scale, dtype: float32, shape: [1]}
activation:
  format: e4m3
  granularity: tensor
  dynamic: false
  scale:
    stored: multiplier
    tensor: {name: input_scale, dtype: float32, shape: [1]}
"""

W4A8_PAIR_KERNEL = KernelDeclaration(
    name="w4a8_nvfp4_fp8",
    provider="test",
    priority=10,
    supports=(Supports(("nvfp4",), activations=(ActivationSupport("fp8", "tensor", dynamic=False),)),),
    devices=(DeviceSupport(ANY_DEVICE),),
    implementation="fake_kernels:w4a8",
)


def _nvfp4_fp8_schemes(tmp_path: Path) -> list:
    file = tmp_path / "nvfp4_fp8.yaml"
    file.write_text(NVFP4_WEIGHTS_FP8_INPUTS)
    return [builtin_scheme("modelopt/W4A8_NVFP4_FP8"), parse_scheme_file(file)]


def test_nvfp4_weights_with_fp8_inputs_fail_naming_both_formats(tmp_path: Path) -> None:
    for scheme in _nvfp4_fp8_schemes(tmp_path):
        for device in ("sm100", "sm90", "cpu"):
            resolution = resolve(scheme, SQUARE, fake_device(device), AS_IF_IMPLEMENTED)
            assert resolution.kernel is None
            assert all(c.stage == "scheme" for c in resolution.trace)
            message = no_kernel_message(resolution, declarations=AS_IF_IMPLEMENTED)
            assert "No kernel implements nvfp4 weights with fp8 static per tensor activations." in message
            assert "none (16-bit)                  marlin, dequant_gemm, triton, cpu_gemv, reference" in message
            assert "nvfp4 dynamic per group of 16  native_fp4, dequant_gemm, triton, cpu_gemv, reference" in message
    # The pairing table is computed from the declarations, not written down anywhere.
    assert activation_pairings("nvfp4", AS_IF_IMPLEMENTED) == [
        ("none (16-bit)", ["marlin", "dequant_gemm", "triton", "cpu_gemv", "reference"]),
        ("nvfp4 dynamic per group of 16", ["native_fp4", "dequant_gemm", "triton", "cpu_gemv", "reference"]),
    ]


def test_nvfp4_weights_with_fp8_inputs_resolve_once_a_kernel_declares_the_pair(tmp_path: Path) -> None:
    declarations = (*AS_IF_IMPLEMENTED, implemented(W4A8_PAIR_KERNEL))
    for scheme in _nvfp4_fp8_schemes(tmp_path):
        resolution = resolve(scheme, SQUARE, fake_device("sm90"), declarations)
        assert resolution.kernel is not None and resolution.kernel.name == "w4a8_nvfp4_fp8"
    pairings = dict(activation_pairings("nvfp4", declarations))
    assert pairings["fp8 static per tensor"] == ["w4a8_nvfp4_fp8"]


def test_scheme_stage_reasons() -> None:
    device = fake_device("sm90")
    int8 = resolve(builtin_scheme("compressed-tensors/W8A8"), SQUARE, device, AS_IF_IMPLEMENTED)
    assert reasons_at(int8.candidate("native_fp4"), "scheme") == "implements nvfp4 weights; scheme has int8 weights"
    assert reasons_at(int8.candidate("native_mxfp4"), "scheme") == "implements mxfp4 weights; scheme has int8 weights"
    assert reasons_at(int8.candidate("tinygemm"), "scheme") == (
        "implements blocks, int4 weights; scheme has int8 weights"
    )
    assert int8.candidate("marlin").reason == (
        "takes int8 weights with none (16-bit) activations; scheme has int8 dynamic per token activations"
    )
    mxfp4 = resolve(builtin_scheme("compressed-tensors/MXFP4A16"), SQUARE, device, AS_IF_IMPLEMENTED)
    assert mxfp4.candidate("marlin").reason == "implements fp8, int4, int8, nvfp4 weights; scheme has mxfp4 weights"
    fp8_blocks = builtin_scheme("modelopt/fp8_pb_wo")
    assert resolve(fp8_blocks, SQUARE, device, AS_IF_IMPLEMENTED).kernel == implemented(MARLIN)  # 128x128 blocks
    assert fp8_blocks.weight.scale is not None
    small_blocks = replace(
        fp8_blocks, weight=replace(fp8_blocks.weight, scale=replace(fp8_blocks.weight.scale, block=(64, 64)))
    )
    block = resolve(small_blocks, SQUARE, device, AS_IF_IMPLEMENTED)
    assert block.candidate("marlin").reason == "takes fp8 weight blocks of 128x128; scheme has 64x64 blocks"
    group32 = KernelDeclaration(
        "g32", "test", 1, (Supports(("int4",), group_sizes=(32,)),), (DeviceSupport(ANY_DEVICE),), "fake_kernels:x"
    )
    w4a16 = resolve(builtin_scheme("compressed-tensors/W4A16"), SQUARE, device, [group32])
    assert w4a16.candidate("g32").reason == "takes int4 weight groups of 32; scheme has groups of 128"
    symmetric = KernelDeclaration(
        "sym", "test", 1, (Supports(("int4",), activations=(WEIGHT_ONLY,)),), (DeviceSupport(ANY_DEVICE),), "m:x"
    )
    asym = resolve(builtin_scheme("compressed-tensors/W4A16_ASYM"), SQUARE, device, [symmetric])
    assert reasons_at(asym.candidate("sym"), "scheme") == "takes symmetric int4 weights only; scheme has zero points"


def test_facts_without_modules_say_how_to_build_complete_ones() -> None:
    from qscheme.kernels.devices import device_facts

    bare = resolve(builtin_scheme("compressed-tensors/W4A16"), SQUARE, device_facts("cpu"), BUILTIN_DECLARATIONS)
    assert bare.kernel is None
    assert "these device facts list no importable module at all: build them with " in (
        bare.candidate("reference").reason
    )


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (("compressed-tensors/W4A16", SQUARE, "sm90"), "resolve\\(\\) takes a Scheme, not str"),
        ((None, SQUARE, "sm90"), "resolve\\(\\) takes a Scheme, not NoneType"),
        (("scheme", (4096, 4096), "sm90"), "resolve\\(\\) takes a Problem, not tuple"),
        (("scheme", SQUARE, "sm90"), "resolve\\(\\) takes a DeviceFacts, not str 'sm90'"),
    ],
)
def test_arguments_of_the_wrong_type_are_usage_errors(arguments: tuple[object, ...], message: str) -> None:
    scheme, problem, device = arguments
    if scheme == "scheme":
        scheme = builtin_scheme("compressed-tensors/W4A16")
    with pytest.raises(UsageError, match=message):
        resolve(scheme, problem, device, BUILTIN_DECLARATIONS)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("n", "message"), [(64.5, "Problem.n must be an int, not 64.5"), (True, "not True"), (0, "N >= 1")]
)
def test_problem_sizes_are_positive_ints(n: object, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        Problem(n, 128)  # type: ignore[arg-type]


# --- activation element and scale formats ---------------------------------------------------


E5M2_KERNEL = KernelDeclaration(
    name="e5m2_tokens",
    provider="test",
    priority=10,
    supports=(
        Supports(
            ("fp8",),
            activations=(ActivationSupport("fp8", "token", dynamic=True, formats=("e5m2",), scale_formats=("bf16",)),),
        ),
    ),
    devices=(DeviceSupport(ANY_DEVICE),),
    implementation="fake_kernels:e5m2",
)


def test_activation_formats_no_kernel_runs_fail_at_resolution_naming_the_format(tmp_path: Path) -> None:
    file = tmp_path / "e5m2.yaml"
    file.write_text(E5M2_PER_TOKEN)
    scheme = parse_scheme_file(file)
    devices = [fake_device(name) for name in ("sm100", "sm90", "sm80", "cpu")]
    for device in (*devices, fake_device("cpu", environment=INTERPRETED)):
        resolution = resolve(scheme, SQUARE, device, AS_IF_IMPLEMENTED)
        assert resolution.kernel is None
        assert all(c.stage == "scheme" for c in resolution.trace)
        for name in ("native_fp8_rowwise", "native_fp8_cpu", "triton", "reference"):
            assert reasons_at(resolution.candidate(name), "scheme") == (
                "takes fp8 weights with fp8 dynamic per token (e4m3, fp32/float scales) activations; "
                "scheme has fp8 dynamic per token (e5m2, bf16 scales) activations"
            )
        # Kernels that fail on more than the formats keep the usual wording.
        assert reasons_at(resolution.candidate("marlin"), "scheme") == (
            "takes fp8 weights with none (16-bit) activations; scheme has fp8 dynamic per token activations"
        )
        with pytest.raises(NoKernelError) as raised:
            resolution.require(declarations=AS_IF_IMPLEMENTED)
        message = str(raised.value)
        assert "No kernel implements fp8 weights with fp8 dynamic per token (e5m2, bf16 scales) activations." in message
        assert (
            "fp8 dynamic per token (e4m3, fp32/float scales)            native_fp8_rowwise, dequant_gemm, triton, "
            "cpu_gemv, reference, native_fp8_cpu" in message
        )
        assert (
            "fp8 static per tensor (e4m3, fp32/float/fp16/bf16 scales)  native_fp8, native_fp8_rowwise, dequant_gemm, "
            "triton, cpu_gemv, reference, native_fp8_cpu" in message
        )
        assert (
            "fp8 dynamic per group of 128 (e4m3, fp32/float scales)     native_fp8_block, dequant_gemm, triton, "
            "cpu_gemv, reference" in message
        )
    # A plugin kernel declaring the format takes the scheme.
    declarations = (*AS_IF_IMPLEMENTED, implemented(E5M2_KERNEL))
    resolution = resolve(scheme, SQUARE, fake_device("sm90"), declarations)
    assert resolution.kernel is not None and resolution.kernel.name == "e5m2_tokens"
    pairings = dict(activation_pairings("fp8", declarations, formats=True))
    assert pairings["fp8 dynamic per token (e5m2, bf16 scales)"] == ["e5m2_tokens"]
    # ... and only that format: e4m3 per-token activations with fp32 scales are not its.
    e4m3 = builtin_scheme("compressed-tensors/FP8_DYNAMIC")
    assert resolve(e4m3, SQUARE, fake_device("cpu"), [implemented(E5M2_KERNEL)]).candidate("e5m2_tokens").reason == (
        "takes fp8 weights with fp8 dynamic per token (e5m2, bf16 scales) activations; "
        "scheme has fp8 dynamic per token (e4m3, fp32 scales) activations"
    )


# --- weight element formats (Supports.weight_formats) ------------------------------------------

# e5m2 weights (one scale per tensor) with static per-tensor e4m3 inputs: the fp8 family, but not the
# e4m3 weights the native FP8 kernels take.
E5M2_WEIGHTS_STATIC_INPUTS = """\
name: test/fp8-e5m2-weights-static-inputs
weight:
  format: e5m2
  tensor: {name: weight, dtype: float8_e5m2, shape: [N, K]}
  scale:
    granularity: tensor
    format: fp32
    stored: multiplier
    tensor: {name: weight_scale, dtype: float32, shape: [1]}
activation:
  format: e4m3
  granularity: tensor
  dynamic: false
  scale:
    stored: multiplier
    tensor: {name: input_scale, dtype: float32, shape: [1]}
"""

E5M2_WEIGHTS_KERNEL = KernelDeclaration(
    name="e5m2_weights",
    provider="test",
    priority=95,
    supports=(
        Supports(("fp8",), weight_formats=("e5m2",), activations=(ActivationSupport("fp8", "tensor", dynamic=False),)),
    ),
    devices=(DeviceSupport(ANY_DEVICE),),
    implementation="fake_kernels:e5m2_weights",
)


def _e5m2_weights(tmp_path: Path) -> Scheme:
    file = tmp_path / "e5m2_weights.yaml"
    file.write_text(E5M2_WEIGHTS_STATIC_INPUTS)
    return parse_scheme_file(file)


def test_weight_element_formats_a_kernel_does_not_take_are_rejected_at_the_scheme_stage(tmp_path: Path) -> None:
    scheme = _e5m2_weights(tmp_path)
    assert (scheme.weight_family, scheme.weight.format) == ("fp8", "e5m2")
    wrong_format = "takes fp8 weights in e4m3; scheme has e5m2 weights"
    for device_name, native, winner in (("sm90", "native_fp8", "triton"), ("cpu", "native_fp8_cpu", "reference")):
        resolution = resolve(scheme, SQUARE, fake_device(device_name), AS_IF_IMPLEMENTED)
        rejected = resolution.candidate(native)
        assert not rejected.accepted and rejected.stage == "scheme"
        assert [(f.stage, f.reason) for f in rejected.failures] == [("scheme", wrong_format)]
        assert resolution.kernel is not None and resolution.kernel.name == winner
        assert resolution.candidate("reference").accepted  # the reference takes any fp8 element format
    # The same scheme with e4m3 weights: the format was the only thing in the way.
    e4m3 = replace(scheme, weight=replace(scheme.weight, format="e4m3"))
    on_gpu = resolve(e4m3, SQUARE, fake_device("sm90"), AS_IF_IMPLEMENTED)
    assert on_gpu.kernel is not None and on_gpu.kernel.name == "native_fp8"
    on_cpu = resolve(e4m3, SQUARE, fake_device("cpu"), AS_IF_IMPLEMENTED)
    assert (
        on_cpu.candidate("native_fp8_cpu").reason
        == "not chosen: cpu_gemv, dequant_gemm rank higher for the M it is meant for"
    )
    # A kernel that declares e5m2 weights takes the scheme, and only e5m2 ones.
    declarations = (*AS_IF_IMPLEMENTED, implemented(E5M2_WEIGHTS_KERNEL))
    taken = resolve(scheme, SQUARE, fake_device("sm90"), declarations)
    assert taken.kernel is not None and taken.kernel.name == "e5m2_weights"
    refused = resolve(e4m3, SQUARE, fake_device("sm90"), declarations).candidate("e5m2_weights")
    assert reasons_at(refused, "scheme") == "takes fp8 weights in e5m2; scheme has e4m3 weights"


def _with_activation(base: str, **changes: object) -> Scheme:
    scheme = builtin_scheme(base)
    assert scheme.activation is not None
    return replace(scheme, activation=replace(scheme.activation, **changes))


def _activation_variants() -> list[Scheme]:
    """Activation blocks around the supported ones, each with the weights the kernels pair it with."""
    static_scale = builtin_scheme("compressed-tensors/FP8").activation.scale  # type: ignore[union-attr]
    assert static_scale is not None
    variants = []
    scale_formats = ("e4m3", "e8m0", "fp32", "fp16", "bf16", "float")
    for element, base in (("e4m3", "compressed-tensors/FP8_DYNAMIC"), ("e5m2", "compressed-tensors/FP8_DYNAMIC")):
        for scale_format in scale_formats:
            variants.append(_with_activation(base, format=element, scale_format=scale_format))
            variants.append(
                _with_activation(base, format=element, granularity="group", group_size=128, scale_format=scale_format)
            )
            variants.append(
                _with_activation(base, format=element, granularity="group", group_size=64, scale_format=scale_format)
            )
            for static_format in scale_formats:
                variants.append(
                    _with_activation(
                        base,
                        format=element,
                        granularity="tensor",
                        dynamic=False,
                        scale_format=scale_format,
                        scale=replace(static_scale, format=static_format),
                    )
                )
    for element in ("int8", "uint8"):
        for scale_format in scale_formats:
            variants.append(_with_activation("compressed-tensors/W8A8", format=element, scale_format=scale_format))
    for size in (16, 32, 64):
        variants.append(_with_activation("compressed-tensors/NVFP4", group_size=size))
        variants.append(_with_activation("compressed-tensors/MXFP4", group_size=size))
    return variants


def test_builtin_activation_claims_agree_with_the_emulation_and_the_triton_pre_pass() -> None:
    """The reference kernel takes exactly what qscheme.emulation runs (with a float static scale,
    as the Triton pre-pass and the canonical float32 input_scale need); Triton nothing its
    pre-pass lacks. No built-in kernel is ever chosen for a scheme whose first forward would fail."""
    from qscheme.emulation import activation_rule
    from qscheme.errors import QuantizeError
    from qscheme.triton.spec import unsupported_reason

    float_formats = ("fp32", "float", "fp16", "bf16")
    reference_only = [implemented(REFERENCE)]
    triton_only = [implemented(TRITON)]
    taken = 0
    for scheme in _activation_variants():
        activation = scheme.activation
        assert activation is not None
        try:
            activation_rule(activation)
            emulated = activation.scale is None or activation.scale.format in float_formats
        except QuantizeError:
            emulated = False
        reference = resolve(scheme, SQUARE, fake_device("cpu"), reference_only).kernel is not None
        assert reference == emulated, activation
        triton = resolve(scheme, SQUARE, fake_device("sm90"), triton_only).kernel is not None
        if triton:
            assert unsupported_reason(scheme) is None, activation
            assert emulated, activation  # its tests compare it with the emulation
        taken += reference
    assert taken == 2 + 2 + 2 + 4 * 4 + 1 + 1  # per token, per group of 128, int8, static, NVFP4, MXFP4


# --- YAML-only schemes the kernels run (NVFP4 inputs with other e2m1 weights, zero points with int8 inputs)

TRITON_SCHEMES = Path(__file__).parent / "data" / "triton_schemes"


@pytest.mark.parametrize("file", ["fp4_g64_fp16_nvfp4_input.yaml", "uint8_channel_e4m3_int8_token.yaml"])
@pytest.mark.parametrize("device_name", ["sm80", "sm90"])
def test_the_repo_triton_test_schemes_resolve_to_triton(file: str, device_name: str) -> None:
    """The Triton and reference kernels run e2m1 weights with float group scales under NVFP4 inputs,
    and uint8 weights with zero points under int8 per-token inputs: both are declared."""
    scheme = parse_scheme_file(TRITON_SCHEMES / file)
    resolution = resolve(scheme, SQUARE, fake_device(device_name), AS_IF_IMPLEMENTED)
    assert resolution.kernel is not None and resolution.kernel.name == "triton", resolution.trace
    assert resolution.candidate("reference").accepted
    on_cpu = resolve(scheme, SQUARE, fake_device("cpu"), AS_IF_IMPLEMENTED)
    assert on_cpu.kernel is not None and on_cpu.kernel.name == "cpu_gemv"


def _nvfp4_group(size: int) -> Scheme:
    scheme = builtin_scheme("compressed-tensors/NVFP4")
    return replace(scheme, weight=replace(scheme.weight, scale=replace(scheme.weight.scale, group_size=size)))


@pytest.mark.parametrize("group_size", [16, 24, 32, 64, 128])
def test_nvfp4_weights_with_nvfp4_inputs_run_on_triton_for_any_group_size(group_size: int) -> None:
    """The kernel decodes weight scales of any group size in the K loop, independently of the
    input's groups of 16, so Triton declares no weight group size for the NVFP4 pair."""
    resolution = resolve(_nvfp4_group(group_size), SQUARE, fake_device("sm90"), AS_IF_IMPLEMENTED)
    assert resolution.kernel is not None and resolution.kernel.name == "triton", resolution.trace


def test_int8_zero_points_with_int8_inputs_are_declared_by_both_builtin_kernels() -> None:
    scheme = builtin_scheme("compressed-tensors/W8A8")
    weight = scheme.weight
    zero_point = parse_scheme_file(TRITON_SCHEMES / "uint8_channel_e4m3_int8_token.yaml").weight.zero_point
    assert zero_point is not None
    asymmetric = replace(scheme, weight=replace(weight, format="uint8", zero_point=zero_point))
    for declaration, device_name in ((TRITON, "sm90"), (REFERENCE, "cpu")):
        resolution = resolve(asymmetric, SQUARE, fake_device(device_name), [implemented(declaration)])
        assert resolution.kernel is not None, resolution.trace


# --- every failing check, and the scheme's own layout -----------------------------------------


def test_a_rejected_kernel_lists_every_failing_check_across_stages() -> None:
    """NVFP4 W4A4 on Marlin on a CPU with a float32 96x96 layer: wrong activations, wrong device and
    a float32 input, each its own failure; ``stage`` stays the first failing one. The shape, off
    Marlin's tiles, is no failure: Marlin pads it (a strict, tile-aligned-only Marlin lists it)."""
    problem = Problem(96, 96, "fp32")  # storable by the scheme (K % 16 == 0), off Marlin's tiles
    scheme_and_device = [
        (
            "scheme",
            "takes nvfp4 weights with none (16-bit) activations; scheme has nvfp4 dynamic per group of 16 activations",
        ),
        ("device", "runs on cuda; device is cpu"),
    ]
    marlin = resolve(builtin_scheme("compressed-tensors/NVFP4"), problem, fake_device("cpu"), AS_IF_IMPLEMENTED)
    candidate = marlin.candidate("marlin")
    assert not candidate.accepted and candidate.stage == "scheme"
    assert [(f.stage, f.reason) for f in candidate.failures] == [
        *scheme_and_device,
        ("problem", "takes bfloat16 or float16 activations; layer has float32"),
    ]
    assert candidate.failures[2].hint == "cast the inputs to bfloat16"
    assert candidate.hint == "cast the inputs to bfloat16"  # the first hint of any check
    strict = resolve(
        builtin_scheme("compressed-tensors/NVFP4"), problem, fake_device("cpu"), STRICT_MARLIN_SET
    ).candidate("strict_marlin")
    assert [(f.stage, f.reason) for f in strict.failures] == [
        *scheme_and_device,
        ("problem", "needs N % 64 == 0 and K % 128 == 0, or N % 128 == 0 and K % 64 == 0; layer has N=96, K=96"),
        ("problem", "takes bfloat16 or float16 activations; layer has float32"),
    ]
    assert strict.hint == "pad the layer to N=128, K=128"  # the first hint of any check
    assert candidate.reason == "; ".join(f.reason for f in candidate.failures)
    assert candidate.as_json()["failures"] == [f.as_json() for f in candidate.failures]
    chosen = marlin.candidate("cpu_gemv")
    assert chosen.chosen and chosen.failures == () and chosen.stage is None


def test_every_mismatch_of_the_closest_supports_entry_is_listed() -> None:
    narrow = KernelDeclaration(
        "narrow", "test", 1, (Supports(("int4",), group_sizes=(32,)),), (DeviceSupport(ANY_DEVICE),), "m:x"
    )
    asym = resolve(
        builtin_scheme("compressed-tensors/W4A16_ASYM"), SQUARE, fake_device("sm90", modules=frozenset({"m"})), [narrow]
    )
    assert reasons_at(asym.candidate("narrow"), "scheme") == (
        "takes int4 weight groups of 32; scheme has groups of 128; "
        "takes symmetric int4 weights only; scheme has zero points"
    )
    # Every entry misses the activation: only mismatches every entry shares are added.
    two = KernelDeclaration(
        "two",
        "test",
        1,
        (Supports(("int4",), group_sizes=(32,)), Supports(("int4",), group_sizes=(32, 128))),
        (DeviceSupport(ANY_DEVICE),),
        "m:x",
    )
    w8 = replace(
        builtin_scheme("compressed-tensors/W4A16"), activation=builtin_scheme("compressed-tensors/W8A8").activation
    )
    failures = resolve(w8, SQUARE, fake_device("cpu", modules=frozenset({"m"})), [two]).candidate("two").failures
    assert [f.stage for f in failures] == ["scheme"]
    assert failures[0].reason.startswith("takes int4 weights with none (16-bit) activations; scheme has int8")


def test_the_problem_is_judged_even_when_the_scheme_is_not_taken() -> None:
    """A fused layer with different scales, on a kernel whose weight family entries lack
    per-partition scales: the problem row says so next to the scheme row."""
    fused = Problem(6144, 4096, partitions=3, partition_scales_differ=True)
    resolution = resolve(builtin_scheme("compressed-tensors/NVFP4"), fused, fake_device("sm90"), STRICT_MARLIN_SET)
    stages = [f.stage for f in resolution.candidate("strict_marlin").failures]
    assert stages == ["scheme", "problem"]
    assert "3 fused partitions have different scales" in resolution.candidate("strict_marlin").reason
    # Marlin's own entries declare per-partition scales: only the scheme row is left.
    marlin = resolve(builtin_scheme("compressed-tensors/NVFP4"), fused, fake_device("sm90"), AS_IF_IMPLEMENTED)
    assert [f.stage for f in marlin.candidate("marlin").failures] == ["scheme"]


def test_disabled_kernels_still_show_their_other_checks() -> None:
    resolution = resolve(
        builtin_scheme("compressed-tensors/NVFP4"),
        SQUARE,
        fake_device("sm90"),
        AS_IF_IMPLEMENTED,
        disabled={"native_fp4"},
    )
    native = resolution.candidate("native_fp4")
    assert native.stage == "disabled"
    assert [f.stage for f in native.failures] == ["disabled", "device"]


@pytest.mark.parametrize(
    ("scheme_name", "n", "k", "blocked"),
    [
        (
            "compressed-tensors/NVFP4A16",
            4096,
            4097,
            ["weight_packed [N, K/2] needs K % 2 == 0", "weight_scale [N, K/16] needs K % 16 == 0"],
        ),
        ("compressed-tensors/NVFP4A16", 100, 100, ["weight_scale [N, K/16] needs K % 16 == 0"]),
        ("compressed-tensors/MXFP4", 64, 48, ["weight_scale [N, K/32] needs K % 32 == 0"]),
        ("modelopt/W4A16_AWQ", 4095, 4096, ["weight [N/2, K] needs N % 2 == 0"]),
    ],
)
def test_a_layer_the_scheme_cannot_store_gets_no_kernel(scheme_name: str, n: int, k: int, blocked: list[str]) -> None:
    scheme = builtin_scheme(scheme_name)
    resolution = resolve(scheme, Problem(n, k), fake_device("sm100"), AS_IF_IMPLEMENTED)
    assert resolution.kernel is None and resolution.layout is not None
    layout = resolution.layout
    assert layout.stage == "layout"
    assert layout.reason.startswith(f"scheme {scheme_name} stores layers with ")
    assert f"not N={n}, K={k}" in layout.reason
    for text in blocked:
        assert text in layout.reason
    # Kernels are still judged; those that would run it say why they are not chosen.
    accepted = [c for c in resolution.trace if c.accepted]
    assert accepted and all("cannot store this layer (see layout)" in c.reason for c in accepted)
    assert not any(c.chosen for c in resolution.trace)
    with pytest.raises(NoKernelError, match=f"^the scheme cannot store the layer \\(scheme {scheme_name}; "):
        resolution.require()


def test_the_layout_hint_names_the_nearest_size_the_scheme_stores() -> None:
    scheme = builtin_scheme("compressed-tensors/NVFP4A16")
    resolution = resolve(scheme, Problem(4096, 4097), fake_device("sm90"), AS_IF_IMPLEMENTED)
    assert resolution.layout is not None
    assert "stores layers with K % 16 == 0, not N=4096, K=4097" in resolution.layout.reason
    assert resolution.layout.hint.startswith("pad the layer to N=4096, K=4112 for scheme compressed-tensors/NVFP4A16")
    padded = resolve(scheme, Problem(4096, 4112), fake_device("sm90"), AS_IF_IMPLEMENTED)
    assert padded.layout is None and padded.kernel is not None


@pytest.mark.parametrize(
    "scheme_name", ["compressed-tensors/W4A16", "compressed-tensors/W4A16_ASYM", "compressed-tensors/FP8_BLOCK"]
)
def test_padded_layouts_store_any_shape(scheme_name: str) -> None:
    """``ceil(K/d)`` shapes pad: any N and K can be stored."""
    for n, k in ((4097, 4097), (1, 1), (100, 130)):
        resolution = resolve(builtin_scheme(scheme_name), Problem(n, k), fake_device("cpu"), AS_IF_IMPLEMENTED)
        assert resolution.layout is None, resolution.layout


def test_the_layout_is_read_from_the_descriptor(tmp_path: Path) -> None:
    """Declaring the same tensors without padding constrains K: no per-scheme table decides."""
    source = Path(__file__).resolve().parents[1] / "schemes" / "compressed-tensors" / "W4A16.yaml"
    text = source.read_text().replace("compressed-tensors/W4A16", "test/exact-W4A16")
    text = text.replace('"ceil(K/8)"', "K/8").replace('"ceil(K/128)"', "K/128")
    file = tmp_path / "exact.yaml"
    file.write_text(text)
    scheme = parse_scheme_file(file)
    resolution = resolve(scheme, Problem(4096, 4100), fake_device("cpu"), AS_IF_IMPLEMENTED)
    assert resolution.layout is not None
    assert "weight_packed [N, K/8] needs K % 8 == 0" in resolution.layout.reason
    assert "weight_scale [N, K/128] needs K % 128 == 0" in resolution.layout.reason
    assert "stores layers with K % 128 == 0" in resolution.layout.reason
    assert resolution.layout.hint.startswith("pad the layer to N=4096, K=4224")
    assert resolve(scheme, Problem(4096, 4096), fake_device("cpu"), AS_IF_IMPLEMENTED).layout is None


class _RaisingCheck:
    def check(self, problem: Problem) -> object:
        raise ZeroDivisionError("check blew up")

    def describe(self) -> str:
        return "raises"


class _WrongReturnCheck:
    def check(self, problem: Problem) -> object:
        return "fine"

    def describe(self) -> str:
        return "returns a string"


class _ExitingCheck:
    def check(self, problem: Problem) -> object:
        raise SystemExit(5)  # sys.exit in a plugin's check must not end the command

    def describe(self) -> str:
        return "exits"


class _BadFieldsCheck:
    def check(self, problem: Problem) -> object:
        return CheckResult(False, 123, None)  # type: ignore[arg-type]

    def describe(self) -> str:
        raise RuntimeError("describe blew up")


def test_a_plugin_check_whose_describe_fails_is_listed_as_such() -> None:
    broken = replace(REFERENCE, name="acme_kernel", plugin="acme", checks=(_BadFieldsCheck(),))  # type: ignore[arg-type]
    assert broken.as_json()["checks"] == ["_BadFieldsCheck (its describe() raised RuntimeError: describe blew up)"]


@pytest.mark.parametrize(
    ("check", "found"),
    [
        (_RaisingCheck(), "its check _RaisingCheck (plugin acme) raised ZeroDivisionError: check blew up"),
        (
            _WrongReturnCheck(),
            "its check _WrongReturnCheck (plugin acme) returned 'fine', not a CheckResult(ok: bool, reason: str, "
            "hint: str)",
        ),
        (_ExitingCheck(), "its check _ExitingCheck (plugin acme) raised SystemExit: 5"),
        (
            _BadFieldsCheck(),
            "its check _BadFieldsCheck (plugin acme) returned CheckResult(ok=False, reason=123, hint=None), not a "
            "CheckResult(ok: bool, reason: str, hint: str)",
        ),
    ],
    ids=["raises", "wrong-return", "sys-exit", "bad-fields"],
)
def test_a_plugin_check_that_fails_rejects_its_kernel_only(check: object, found: str) -> None:
    broken = replace(REFERENCE, name="acme_kernel", priority=90, plugin="acme", checks=(check,))  # type: ignore[arg-type]
    resolution = resolve(builtin_scheme("compressed-tensors/W4A16"), SQUARE, fake_device("cpu"), [broken, REFERENCE])
    assert resolution.kernel is not None and resolution.kernel.name == "reference"
    rejected = resolution.candidate("acme_kernel")
    assert rejected is not None and not rejected.accepted and rejected.stage == "problem"
    assert rejected.reason == found
    assert rejected.hint == "fix the plugin's check, or skip the kernel: QSCHEME_DISABLED_KERNELS=acme_kernel"
