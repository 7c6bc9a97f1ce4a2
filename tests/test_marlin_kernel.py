"""The ``marlin`` kernel on vLLM's ops, tested on the CPU with a stub vLLM (tests/fake_vllm).

The stub's ``gptq_marlin_repack`` and ``marlin_gemm`` record their arguments and return tensors of
the shapes vLLM 0.33's fake implementations give: these tests check what the kernel hands vLLM
(operands, scalar types, padding, workspace, bias, slicing), not the GEMM's numbers. The
operands themselves are ``marlin_layout``'s, checked against vLLM's Python helpers in
tests/test_marlin_layout.py. The GPU test at the end compares the real GEMM with the reference
kernel where a CUDA GPU and vLLM 0.33 are present.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from kernel_fakes import AS_IF_IMPLEMENTED, all_modules, builtin_scheme, fake_device, isolated_plugins
from qscheme_plugins import marlin_kernel
from qscheme_plugins.marlin import MARLIN, VLLM_VERSIONS
from qscheme_plugins.marlin_layout import marlin_operands, marlin_permute_bias

from qscheme.canonical import CanonicalWeight
from qscheme.descriptor import Scheme, parse_scheme_text
from qscheme.kernels import registry
from qscheme.kernels.devices import DeviceFacts
from qscheme.kernels.problem import Problem
from qscheme.kernels.render import render_resolution
from qscheme.kernels.resolver import Resolution, resolve
from qscheme.triton.samples import random_weight

FAKE_VLLM = Path(__file__).parent / "fake_vllm"
SNAPSHOTS = Path(__file__).parent / "snapshots" / "marlin"
UPDATE = os.environ.get("QSCHEME_UPDATE_SNAPSHOTS") == "1"

INT8_WEIGHT_ONLY = """
name: test/int8-weight-only-channel
weight:
  format: int8
  tensor: {name: weight, dtype: int8, shape: [N, K]}
  scale:
    granularity: channel
    format: float
    stored: multiplier
    tensor: {name: weight_scale, dtype: [bfloat16, float32], shape: [N, 1]}
activation: none
"""
FP8_WEIGHT_ONLY = """
name: test/fp8-weight-only-channel
weight:
  format: e4m3
  tensor: {name: weight, dtype: float8_e4m3fn, shape: [N, K]}
  scale:
    granularity: channel
    format: float
    stored: multiplier
    tensor: {name: weight_scale, dtype: [float32], shape: [N, 1]}
activation: none
"""


def scheme_named(name: str) -> Scheme:
    if name == "test/int8-weight-only-channel":
        return parse_scheme_text(INT8_WEIGHT_ONLY)
    if name == "test/fp8-weight-only-channel":
        return parse_scheme_text(FP8_WEIGHT_ONLY)
    return builtin_scheme(name)


# Each scheme the kernel claims, with the vLLM scalar type Marlin runs it as.
CLAIMED: dict[str, str] = {
    "compressed-tensors/NVFP4A16": "float4_e2m1f",
    "modelopt/W4A16_NVFP4": "float4_e2m1f",
    "compressed-tensors/W4A16": "uint4b8",
    "compressed-tensors/W4A16_ASYM": "uint4",
    "modelopt/W4A16_AWQ": "uint4b8",
    "modelopt/fp8_pb_wo": "float8_e4m3fn",
    "test/int8-weight-only-channel": "uint8b128",
    "test/fp8-weight-only-channel": "float8_e4m3fn",
    # issue 27's producers: GPTQ and AWQ layers load into compressed-tensors' int tensors
    # (tests/test_marlin_producers.py checks them against vLLM's own GPTQ/AWQ linear methods)
    "gptq/W4A16": "uint4b8",
    "gptq/W4A16_ASYM": "uint4",
    "gptq_v2/W4A16_G32": "uint4b8",
    "gptq/W8A16": "uint8b128",
    "gptq/W8A16_CHANNEL": "uint8b128",
    "awq/W4A16_ASYM": "uint4",
}
# What marlin_mxfp4 (the same code) claims: MXFP4 with bfloat16 activations only (gpt-oss's experts included).
MXFP4_CLAIMED = ("compressed-tensors/MXFP4A16", "mxfp4/MXFP4")
# The GPU check's cases: every claimed scheme in both activation dtypes, MXFP4 in bfloat16.
GPU_CASES = [(name, dtype) for name in sorted(CLAIMED) for dtype in (torch.bfloat16, torch.float16)] + [
    (name, torch.bfloat16) for name in MXFP4_CLAIMED
]


# --- the stub vLLM ------------------------------------------------------------------------------


def _drop_vllm_modules() -> dict[str, ModuleType]:
    dropped = {name: module for name, module in sys.modules.items() if name == "vllm" or name.startswith("vllm.")}
    for name in dropped:
        del sys.modules[name]
    return dropped


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """vllm._custom_ops of the stub vLLM 0.33.0 (importable as ``vllm``), with its Marlin ops."""
    saved = _drop_vllm_modules()
    monkeypatch.syspath_prepend(str(FAKE_VLLM))
    custom_ops = importlib.import_module("vllm._custom_ops")
    custom_ops.CALLS.clear()
    monkeypatch.setattr(custom_ops, "COMPILED", {"gptq_marlin_repack", "marlin_gemm"})
    monkeypatch.setattr(marlin_kernel, "compiled_op_names", lambda ops: set(ops.COMPILED))
    try:
        yield custom_ops
    finally:
        _drop_vllm_modules()
        sys.modules.update(saved)


def calls(custom_ops: ModuleType, name: str) -> list[dict[str, Any]]:
    return [arguments for op, arguments in custom_ops.CALLS if op == name]


def canonical(name: str, n: int, k: int, partitions: tuple[int, ...] | None = None, seed: int = 0) -> CanonicalWeight:
    return random_weight(scheme_named(name), n, k, partitions=partitions, seed=seed)


# --- binding to vLLM -----------------------------------------------------------------------------


def test_the_declaration_module_imports_no_torch() -> None:
    import qscheme_plugins.marlin as declaration_module

    assert "torch" not in vars(declaration_module)
    assert MARLIN.implementation == "qscheme_plugins.marlin_kernel:MarlinKernel"
    assert MARLIN.requires_versions == (("vllm", ">=0.33,<0.34"),)


def test_a_supported_vllm_binds_its_ops(fake_vllm: ModuleType) -> None:
    kernel = marlin_kernel.MarlinKernel()
    assert kernel.ops is fake_vllm
    assert kernel.vllm_version == "0.33.0"


def test_a_vllm_without_compiled_marlin_ops_is_refused_as_a_cpu_build(
    fake_vllm: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fake_vllm, "COMPILED", set())
    with pytest.raises(
        ImportError,
        match=r"vllm 0\.33\.0's compiled Marlin ops are not loaded \(gptq_marlin_repack, marlin_gemm\): a CPU build",
    ):
        marlin_kernel.MarlinKernel()


def test_a_vllm_outside_the_supported_range_is_refused_with_both_versions(
    fake_vllm: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys.modules["vllm"], "__version__", "0.35.0")
    with pytest.raises(ImportError, match=r"needs vllm >=0\.33,<0\.34; vllm 0\.35\.0 is installed"):
        marlin_kernel.MarlinKernel()


def test_an_absent_vllm_is_an_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    saved = _drop_vllm_modules()
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    try:
        with pytest.raises(ImportError, match="vllm does not import"):
            marlin_kernel.MarlinKernel()
    finally:
        sys.modules.update(saved)


def test_the_real_ops_probe_reads_torch_ops() -> None:
    # torch 2.13 here has no vLLM ops registered: the probe finds none
    assert marlin_kernel.compiled_op_names(None) == set()


# --- prepare and apply: what reaches vLLM's ops --------------------------------------------------


@pytest.mark.parametrize("name", sorted(CLAIMED))
def test_prepare_and_apply_hand_vllm_the_layouts_of_marlin_layout(name: str, fake_vllm: ModuleType) -> None:
    n, k = 96, 256  # N off Marlin's 64-tile: padded to 128
    weight = canonical(name, n, k, seed=3)
    kernel = marlin_kernel.MarlinKernel()
    state = kernel.prepare(weight, torch.device("cpu"))
    expected = marlin_operands(weight, torch.bfloat16)

    (repack,) = calls(fake_vllm, "gptq_marlin_repack")
    assert torch.equal(repack["b_q_weight"], expected.packed_weight)
    assert (repack["size_k"], repack["size_n"], repack["num_bits"], repack["is_a_8bit"]) == (
        expected.padded_k,
        expected.padded_n,
        expected.bits,
        False,
    )
    assert (expected.padded_n, expected.padded_k) == (128, 256)

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, k, generator=generator).to(torch.bfloat16)
    bias = torch.randn(n, generator=generator).to(torch.bfloat16)
    y = kernel.apply(state, x, bias)
    (gemm,) = calls(fake_vllm, "marlin_gemm")

    rows = x.reshape(-1, k)
    if weight.input_pre_scale is not None:
        rows = rows * weight.input_pre_scale.to(torch.bfloat16)
    assert gemm["a"].dtype == torch.bfloat16 and torch.equal(gemm["a"], rows)
    assert gemm["b_q_weight"] is state.gemms[0].weight
    assert gemm["b_q_weight"].shape == (expected.padded_k // 16, expected.padded_n * 16 * expected.bits // 32)
    assert torch.equal(gemm["b_scales"].view(torch.uint8), expected.scales.view(torch.uint8))
    assert gemm["b_scales"].dtype == expected.scales.dtype
    if expected.global_scale is None:
        assert gemm["global_scale"] is None
    else:
        assert torch.equal(gemm["global_scale"], expected.global_scale)
    if expected.zero_points is None:
        assert gemm["b_zeros"] is None
    else:
        assert torch.equal(gemm["b_zeros"], expected.zero_points)
    assert gemm["b_q_type"].name == CLAIMED[name]
    assert (gemm["size_m"], gemm["size_n"], gemm["size_k"]) == (6, 128, 256)
    assert torch.equal(gemm["b_bias"], marlin_permute_bias(torch.nn.functional.pad(bias, (0, 128 - n))))
    assert gemm["workspace"].dtype == torch.int32 and gemm["workspace"].numel() == marlin_kernel.BLOCKS_PER_SM
    assert gemm["c"] is None and gemm["a_scales"] is None
    assert (gemm["use_atomic_add"], gemm["use_fp32_reduce"], gemm["is_zp_float"]) == (False, True, False)
    # the stub's output holds row + column / 1024: sliced to N, reshaped to [2, 3, N]
    assert y.shape == (2, 3, n) and y.dtype == torch.bfloat16
    expected_y = (torch.arange(6.0).unsqueeze(1) + torch.arange(float(n)) / 1024).to(torch.bfloat16)
    assert torch.equal(y.reshape(6, n), expected_y)


def test_the_stub_refuses_what_the_real_ops_refuse(fake_vllm: ModuleType) -> None:
    """The stub's checks are real: a state whose operands are broken one at a time is refused."""
    weight = canonical("compressed-tensors/W4A16_ASYM", 128, 256)
    kernel = marlin_kernel.MarlinKernel()
    state = kernel.prepare(weight, torch.device("cpu"))
    x = torch.randn(2, 256).to(torch.bfloat16)
    kernel.apply(state, x, None)  # accepted as prepared
    operands = state.gemms[0].operands[torch.bfloat16]
    broken = {
        "b_zeros": replace(operands, zero_points=None),
        "scales must be in the activation dtype": replace(operands, scales=operands.scales.float()),
        "is not a multiple": replace(operands, scales=torch.cat([operands.scales, operands.scales[:1]])),
        "not on Marlin's tiles": replace(operands, padded_n=operands.padded_n + 8),
    }
    for message, bad in broken.items():
        state.gemms[0].operands[torch.bfloat16] = bad
        with pytest.raises(ValueError, match="uint4 type needs zero points" if message == "b_zeros" else message):
            kernel.apply(state, x, None)


def test_k_off_the_tile_pads_the_input_with_zeros(fake_vllm: ModuleType) -> None:
    n, k = 128, 200  # ragged K (groups of 128): padded to 256
    weight = canonical("compressed-tensors/W4A16", n, k)
    kernel = marlin_kernel.MarlinKernel()
    state = kernel.prepare(weight, torch.device("cpu"))
    x = torch.randn(1, k).to(torch.float16)
    y = kernel.apply(state, x, None)
    (gemm,) = calls(fake_vllm, "marlin_gemm")
    assert gemm["size_k"] == 256 and gemm["a"].shape == (1, 256)
    assert torch.equal(gemm["a"][:, :k], x) and not gemm["a"][:, k:].any()
    assert gemm["b_bias"] is None
    assert y.shape == (1, n) and y.dtype == torch.float16


def test_both_dtypes_are_prepared_at_once_and_the_repack_runs_once(fake_vllm: ModuleType) -> None:
    weight = canonical("compressed-tensors/NVFP4A16", 128, 256)
    kernel = marlin_kernel.MarlinKernel()
    state = kernel.prepare(weight, torch.device("cpu"))
    assert len(calls(fake_vllm, "gptq_marlin_repack")) == 1
    assert [set(g.operands) for g in state.gemms] == [{torch.bfloat16, torch.float16}]
    assert all(o.packed_weight.numel() == 0 for g in state.gemms for o in g.operands.values())  # not kept
    kernel.apply(state, torch.randn(1, 256).to(torch.float16), None)
    kernel.apply(state, torch.randn(1, 256).to(torch.float16), None)
    assert len(calls(fake_vllm, "gptq_marlin_repack")) == 1
    gemm = calls(fake_vllm, "marlin_gemm")[-1]
    expected = marlin_operands(weight, torch.float16)
    assert expected.global_scale is not None
    assert torch.equal(gemm["global_scale"], expected.global_scale)
    bf16 = marlin_operands(weight, torch.bfloat16).global_scale
    assert bf16 is not None and not torch.equal(bf16, expected.global_scale)  # 2**119 vs 2**7 exponent bias


def test_fused_nvfp4_partitions_with_different_global_scales_run_one_gemm_each(fake_vllm: ModuleType) -> None:
    partitions = (64, 32, 96)
    weight = canonical("compressed-tensors/NVFP4A16", sum(partitions), 256, partitions=partitions, seed=2)
    assert weight.global_scale is not None and len(set(weight.global_scale.tolist())) == 3
    kernel = marlin_kernel.MarlinKernel()
    state = kernel.prepare(weight, torch.device("cpu"))
    assert [g.start for g in state.gemms] == [0, 64, 96]
    bias = torch.arange(float(sum(partitions))).to(torch.bfloat16)
    y = kernel.apply(state, torch.randn(2, 256).to(torch.bfloat16), bias)
    gemms = calls(fake_vllm, "marlin_gemm")
    assert len(gemms) == 3
    for index, (gemm, size) in enumerate(zip(gemms, partitions, strict=True)):
        start = sum(partitions[:index])
        part = replace(
            weight,
            n=size,
            codes=weight.codes[start : start + size],
            scale=weight.scale[start : start + size],
            global_scale=weight.global_scale[index : index + 1],
            global_scale_divisor=None,
            partitions=(size,),
        )
        expected = marlin_operands(part, torch.bfloat16)
        assert expected.global_scale is not None
        assert torch.equal(gemm["global_scale"], expected.global_scale)
        assert torch.equal(gemm["b_scales"].view(torch.uint8), expected.scales.view(torch.uint8))
        assert gemm["size_n"] == expected.padded_n
        padded_bias = torch.nn.functional.pad(bias[start : start + size], (0, expected.padded_n - size))
        assert torch.equal(gemm["b_bias"], marlin_permute_bias(padded_bias))
    # each piece is its stub output (row + column / 1024) sliced to its partition
    columns = torch.cat([torch.arange(float(size)) for size in partitions]) / 1024
    assert torch.equal(y, (torch.arange(2.0).unsqueeze(1) + columns).to(torch.bfloat16))


def test_fused_partitions_with_equal_global_scales_run_one_gemm(fake_vllm: ModuleType) -> None:
    weight = canonical("compressed-tensors/NVFP4A16", 192, 256, partitions=(64, 64, 64))
    assert weight.global_scale is not None
    weight = replace(weight, global_scale=weight.global_scale[:1].repeat(3))
    kernel = marlin_kernel.MarlinKernel()
    state = kernel.prepare(weight, torch.device("cpu"))
    kernel.apply(state, torch.randn(1, 256).to(torch.bfloat16), None)
    assert len(state.gemms) == 1 and len(calls(fake_vllm, "marlin_gemm")) == 1


UINT4_WEIGHT_ONLY = """
name: test/uint4-no-zero-points
weight:
  format: uint4
  packing: nibbles_k
  tensor: {name: weight, dtype: uint8, shape: [N, K/2]}
  scale:
    granularity: group
    group_size: 64
    format: float
    stored: multiplier
    tensor: {name: weight_scale, dtype: [bfloat16], shape: [N, K/64]}
activation: none
"""


def test_uint4_codes_without_zero_points_run_as_uint4_with_zero_points_0(fake_vllm: ModuleType) -> None:
    scheme = parse_scheme_text(UINT4_WEIGHT_ONLY)
    weight = random_weight(scheme, 64, 128)
    kernel = marlin_kernel.MarlinKernel()
    state = kernel.prepare(weight, torch.device("cpu"))
    kernel.apply(state, torch.randn(1, 128).to(torch.bfloat16), None)
    (gemm,) = calls(fake_vllm, "marlin_gemm")
    assert gemm["b_q_type"].name == "uint4"
    assert gemm["b_zeros"] is not None and not gemm["b_zeros"].any()


def test_empty_inputs_return_empty_outputs_without_a_gemm(fake_vllm: ModuleType) -> None:
    weight = canonical("compressed-tensors/W4A16", 64, 128)
    kernel = marlin_kernel.MarlinKernel()
    state = kernel.prepare(weight, torch.device("cpu"))
    y = kernel.apply(state, torch.zeros(0, 128, dtype=torch.bfloat16), None)
    assert y.shape == (0, 64) and not calls(fake_vllm, "marlin_gemm")


def test_one_workspace_per_device_is_shared_by_layers(fake_vllm: ModuleType) -> None:
    kernel = marlin_kernel.MarlinKernel()
    first = kernel.prepare(canonical("compressed-tensors/W4A16", 64, 128), torch.device("cpu"))
    second = kernel.prepare(canonical("compressed-tensors/NVFP4A16", 64, 128), torch.device("cpu"))
    assert first.workspace is second.workspace


# --- resolution ----------------------------------------------------------------------------------


def vllm_device(version: str | None, name: str = "sm90") -> DeviceFacts:
    """A simulated GPU with vLLM ``version`` installed (None: absent, not importable)."""
    modules = all_modules() if version is not None else all_modules() - {"vllm"}
    facts = fake_device(name, modules=modules)
    return replace(facts, distributions=(("vllm", version),) if version else ())


def trace_entry(resolution: Resolution, kernel: str) -> Any:
    (entry,) = [c for c in resolution.trace if c.kernel == kernel]
    return entry


def check_snapshot(name: str, text: str) -> None:
    path = SNAPSHOTS / f"{name}.txt"
    if UPDATE or not path.exists():
        if not UPDATE and os.environ.get("CI"):
            pytest.fail(f"snapshot {path} is missing; generate it with QSCHEME_UPDATE_SNAPSHOTS=1")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    assert text + "\n" == path.read_text(), f"{path} differs; QSCHEME_UPDATE_SNAPSHOTS=1 regenerates it"


@pytest.mark.parametrize("name", ["compressed-tensors/NVFP4A16", "compressed-tensors/W4A16"])
def test_vllm_0_33_gets_marlin_over_triton_and_tinygemm(name: str) -> None:
    resolution = resolve(builtin_scheme(name), Problem(4096, 4096), vllm_device("0.33.0"), AS_IF_IMPLEMENTED)
    assert resolution.kernel is not None and resolution.kernel.name == "marlin"
    check_snapshot(f"vllm_0_33_{name.split('/')[1]}_sm90", render_resolution(resolution))


@pytest.mark.parametrize("name", sorted(n for n in CLAIMED if not n.startswith("test/")))
def test_every_claimed_builtin_scheme_resolves_to_marlin_with_vllm_0_33(name: str) -> None:
    resolution = resolve(builtin_scheme(name), Problem(4096, 4096), vllm_device("0.33.0", "sm80"), AS_IF_IMPLEMENTED)
    assert resolution.kernel is not None and resolution.kernel.name == "marlin", render_resolution(resolution)


def test_mxfp4_runs_on_marlin_mxfp4_with_bf16_inputs_only() -> None:
    """vLLM 0.33 compiles MXFP4 Marlin for bf16 inputs only: marlin_mxfp4 takes MXFP4 in bf16,
    refuses fp16 with the dtype reason (triton runs it then), and marlin itself never claims MXFP4."""
    scheme = builtin_scheme("compressed-tensors/MXFP4A16")
    device = vllm_device("0.33.0", "sm90")
    bf16 = resolve(scheme, Problem(4096, 4096), device, AS_IF_IMPLEMENTED)
    assert bf16.kernel is not None and bf16.kernel.name == "marlin_mxfp4", render_resolution(bf16)
    assert "scheme has mxfp4 weights" in trace_entry(bf16, "marlin").reason
    fp16 = resolve(scheme, Problem(4096, 4096, activation_dtype="float16"), device, AS_IF_IMPLEMENTED)
    assert fp16.kernel is not None and fp16.kernel.name == "triton"
    assert "takes bfloat16 activations; layer has float16" in trace_entry(fp16, "marlin_mxfp4").reason


def test_mxfp4_operands_reach_the_ops(fake_vllm: ModuleType) -> None:
    weight = canonical("compressed-tensors/MXFP4A16", 128, 256)
    kernel = marlin_kernel.MarlinKernel()
    state = kernel.prepare(weight, torch.device("cpu"))
    y = kernel.apply(state, torch.randn(3, 256).to(torch.bfloat16), None)
    (gemm,) = calls(fake_vllm, "marlin_gemm")
    expected = marlin_operands(weight, torch.bfloat16)
    assert gemm["b_q_type"].name == "float4_e2m1f" and gemm["global_scale"] is None
    assert gemm["b_scales"].dtype == torch.float8_e8m0fnu and torch.equal(
        gemm["b_scales"].view(torch.uint8), expected.scales.view(torch.uint8)
    )
    assert y.shape == (3, 128) and y.dtype == torch.bfloat16


def test_turing_is_not_claimed() -> None:
    """vLLM 0.33's Turing build runs fp16 only; a kernel-wide dtype check cannot say so per device."""
    resolution = resolve(
        builtin_scheme("compressed-tensors/W4A16"),
        Problem(4096, 4096),
        vllm_device("0.33.0", "sm75"),
        AS_IF_IMPLEMENTED,
    )
    assert "needs compute capability 8.0 or newer; device is 7.5" in trace_entry(resolution, "marlin").reason


def test_absent_vllm_leaves_triton() -> None:
    resolution = resolve(
        builtin_scheme("compressed-tensors/NVFP4A16"), Problem(4096, 4096), vllm_device(None), AS_IF_IMPLEMENTED
    )
    assert resolution.kernel is not None and resolution.kernel.name == "triton"
    assert "needs module vllm, not importable here" in trace_entry(resolution, "marlin").reason
    check_snapshot("vllm_absent_NVFP4A16_sm90", render_resolution(resolution))


def test_an_unsupported_vllm_version_is_rejected_with_both_versions() -> None:
    resolution = resolve(
        builtin_scheme("compressed-tensors/NVFP4A16"), Problem(4096, 4096), vllm_device("0.35.0"), AS_IF_IMPLEMENTED
    )
    assert resolution.kernel is not None and resolution.kernel.name == "triton"
    assert "needs vllm >=0.33,<0.34; vllm 0.35.0 is installed" in trace_entry(resolution, "marlin").reason
    check_snapshot("vllm_0_35_NVFP4A16_sm90", render_resolution(resolution))


@pytest.mark.parametrize(("n", "k"), [(4096, 4095), (4097, 4096)])
def test_shapes_off_by_one_tile_are_padded_not_rejected(n: int, k: int) -> None:
    resolution = resolve(
        builtin_scheme("compressed-tensors/W4A16"), Problem(n, k), vllm_device("0.33.0"), AS_IF_IMPLEMENTED
    )
    assert resolution.kernel is not None and resolution.kernel.name == "marlin"
    check_snapshot(f"off_by_one_tile_W4A16_{n}x{k}_sm90", render_resolution(resolution))


def test_fused_nvfp4_with_unequal_global_scales_is_accepted() -> None:
    problem = Problem(6144, 4096, partitions=3, partition_scales_differ=True, layer="model.layers.0.self_attn.qkv_proj")
    resolution = resolve(
        builtin_scheme("compressed-tensors/NVFP4A16"), problem, vllm_device("0.33.0"), AS_IF_IMPLEMENTED
    )
    assert resolution.kernel is not None and resolution.kernel.name == "marlin"
    check_snapshot("fused_unequal_global_scales_NVFP4A16_sm90", render_resolution(resolution))


def test_fp32_inputs_are_rejected_with_the_dtype_reason() -> None:
    scheme = builtin_scheme("compressed-tensors/W4A16")
    fp32 = resolve(scheme, Problem(4096, 4096, "float32"), vllm_device("0.33.0"), AS_IF_IMPLEMENTED)
    assert "takes bfloat16 or float16 activations; layer has float32" in trace_entry(fp32, "marlin").reason


@pytest.mark.parametrize(
    "name",
    ["compressed-tensors/NVFP4", "compressed-tensors/W8A8", "compressed-tensors/FP8", "compressed-tensors/FP8_BLOCK"],
)
def test_activation_quantized_schemes_are_not_claimed(name: str) -> None:
    resolution = resolve(builtin_scheme(name), Problem(4096, 4096), vllm_device("0.33.0"), AS_IF_IMPLEMENTED)
    entry = trace_entry(resolution, "marlin")
    assert not entry.accepted and entry.stage == "scheme"


def test_a_cpu_build_of_vllm_is_rejected_by_the_registry_and_other_kernels_still_resolve(
    fake_vllm: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fake_vllm, "COMPILED", set())
    facts = vllm_device("0.33.0")
    with isolated_plugins():
        resolution = registry.resolve_layer(builtin_scheme("compressed-tensors/NVFP4A16"), Problem(4096, 4096), facts)
        assert resolution.kernel is not None and resolution.kernel.name == "triton"
        entry = trace_entry(resolution, "marlin")
        assert not entry.accepted and entry.stage == "device"
        assert "compiled Marlin ops are not loaded (gptq_marlin_repack, marlin_gemm): a CPU build" in entry.reason
        assert "a CPU build" in registry.verified_failures(registry.declarations(), facts)["marlin"]
        assert any("marlin" in line and "a CPU build" in line for line in registry.unavailable_lines())
        check_snapshot("vllm_cpu_build_NVFP4A16_sm90", render_resolution(resolution))


def test_the_registry_loads_marlin_with_a_supported_vllm(fake_vllm: ModuleType) -> None:
    facts = vllm_device("0.33.0")
    with isolated_plugins():
        _, declaration, implementation = registry.select_kernel(
            builtin_scheme("compressed-tensors/W4A16"), Problem(4096, 4096), facts
        )
        assert declaration.name == "marlin" and isinstance(implementation, marlin_kernel.MarlinKernel)
        assert not registry.implementation_failures()


def test_the_declared_version_range_is_the_implementations() -> None:
    assert dict(MARLIN.requires_versions)["vllm"] == VLLM_VERSIONS


# --- the GEMM on a GPU ---------------------------------------------------------------------------


def _vllm_skip_reason() -> str:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    try:
        marlin_kernel.bind_vllm()
    except ImportError as error:
        return f"needs vLLM {VLLM_VERSIONS} with its CUDA Marlin ops: {error}"
    return ""


@pytest.mark.gpu
@pytest.mark.parametrize(("name", "dtype"), GPU_CASES, ids=[f"{n}-{str(d)[6:]}" for n, d in GPU_CASES])
def test_marlin_matches_the_reference_on_a_gpu(name: str, dtype: torch.dtype) -> None:
    reason = _vllm_skip_reason()
    if reason:
        pytest.skip(reason)
    from qscheme_plugins.reference_kernel import ReferenceKernel

    device = torch.device("cuda")
    weight = canonical(name, 192, 384, partitions=(64, 64, 64), seed=7).to(device)
    x = torch.randn(3, 5, 384, device=device).to(dtype)
    bias = torch.randn(192, device=device).to(dtype)
    kernel = marlin_kernel.MarlinKernel()
    y = kernel.apply(kernel.prepare(weight, device), x, bias).float()
    reference = ReferenceKernel()
    expected = reference.apply(reference.prepare(weight, device), x, bias).float()
    # scales rounded to the activation dtype, fp32 accumulation, one output rounding:
    # |y - y_ref| <= 2^-7 (|x| |W|^T + |y_ref|) for bf16 (2^-10 for fp16), a stated, loose bound
    eps = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    dense = reference.prepare(weight, device).weight.abs()
    pre = weight.input_pre_scale.float().abs() if weight.input_pre_scale is not None else 1.0
    bound = eps * ((x.float().abs() * pre) @ dense.T + expected.abs()) + 1e-6
    assert bool(((y - expected).abs() <= bound).all()), float(((y - expected).abs() - bound).max())
