"""Snapshots of rendered resolutions and no-kernel messages (tests/snapshots/*.txt).

Regenerate after an intended change with ``QSCHEME_UPDATE_SNAPSHOTS=1 pytest tests/test_render.py``
and review the diff: these messages are what users read when nothing runs their layer.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from kernel_fakes import (
    AS_IF_IMPLEMENTED,
    BUILTIN_KERNELS_BY_PRIORITY,
    E5M2_PER_TOKEN,
    STRICT_MARLIN,
    STRICT_MARLIN_SET,
    all_modules,
    builtin_scheme,
    fake_device,
    implemented,
)
from qscheme_plugins.marlin import MARLIN
from qscheme_plugins.native_fp4 import NATIVE_FP4

from qscheme.descriptor import parse_scheme_file
from qscheme.errors import NoKernelError
from qscheme.kernels.declaration import CheckResult, DeviceSupport, KernelDeclaration, Supports
from qscheme.kernels.hints import suggest
from qscheme.kernels.problem import Problem
from qscheme.kernels.render import render_resolution, resolution_json
from qscheme.kernels.resolver import Resolution, resolve
from qscheme.plugins import PluginFailure

SNAPSHOTS = Path(__file__).parent / "snapshots"
UPDATE = os.environ.get("QSCHEME_UPDATE_SNAPSHOTS") == "1"
ALTERNATIVE_DEVICES = [fake_device(name) for name in ("sm80", "sm90", "sm100", "sm120")]
ALTERNATIVE_SCHEMES = ["modelopt/NVFP4", "modelopt/W4A16_NVFP4", "compressed-tensors/NVFP4A16"]
BROKEN = PluginFailure(
    "broken-import",
    "qscheme-broken-plugin",
    "0.1.0",
    "import",
    "ModuleNotFoundError: No module named 'qscheme_example_missing_dependency'",
)


def check_snapshot(name: str, text: str) -> None:
    path = SNAPSHOTS / f"{name}.txt"
    if UPDATE or not path.exists():
        if not UPDATE and os.environ.get("CI"):
            pytest.fail(f"snapshot {path} is missing; generate it with QSCHEME_UPDATE_SNAPSHOTS=1")
        path.parent.mkdir(exist_ok=True)
        path.write_text(text + "\n")
    assert text + "\n" == path.read_text(), f"{path} differs; QSCHEME_UPDATE_SNAPSHOTS=1 regenerates it"


def error_text(
    resolution: Resolution, declarations: Sequence[KernelDeclaration], failures: Sequence[object] = ()
) -> str:
    schemes = [builtin_scheme(name) for name in ALTERNATIVE_SCHEMES]
    hint = suggest(resolution, declarations, ALTERNATIVE_DEVICES, schemes)
    with pytest.raises(NoKernelError) as caught:
        resolution.require(failures, hint, declarations)
    return str(caught.value)


def test_nvfp4_weights_with_fp8_inputs() -> None:
    problem = Problem(4096, 14336, layer="model.layers.0.mlp.down_proj")
    resolution = resolve(builtin_scheme("modelopt/W4A8_NVFP4_FP8"), problem, fake_device("sm100"), AS_IF_IMPLEMENTED)
    check_snapshot("no_kernel_nvfp4_weights_fp8_inputs", error_text(resolution, AS_IF_IMPLEMENTED, [BROKEN]))


def test_forced_kernel_that_cannot_run() -> None:
    problem = Problem(4096, 4096, layer="model.layers.3.self_attn.o_proj")
    resolution = resolve(
        builtin_scheme("compressed-tensors/W4A16"), problem, fake_device("cpu"), AS_IF_IMPLEMENTED, force="marlin"
    )
    check_snapshot("no_kernel_forced_marlin_on_cpu", error_text(resolution, AS_IF_IMPLEMENTED))


def test_fused_partitions_with_different_scales_and_disabled_kernels() -> None:
    """Marlin runs such partitions one GEMM each: a strict, one-global-scale Marlin stands in."""
    problem = Problem(6144, 4096, partitions=3, partition_scales_differ=True, layer="model.layers.0.self_attn.qkv_proj")
    scheme = builtin_scheme("compressed-tensors/NVFP4A16")
    resolution = resolve(scheme, problem, fake_device("sm90"), STRICT_MARLIN_SET, disabled={"triton", "reference"})
    check_snapshot("no_kernel_fused_partitions_disabled", error_text(resolution, STRICT_MARLIN_SET))
    real = resolve(scheme, problem, fake_device("sm90"), AS_IF_IMPLEMENTED, disabled={"triton", "reference"})
    assert real.kernel is not None and real.kernel.name == "marlin"


def test_problem_stage_hint() -> None:
    """A kernel that takes tile-aligned shapes only (Marlin pads them: a strict Marlin stands in)."""
    declarations = [STRICT_MARLIN]
    problem = Problem(4096, 4000, layer="model.layers.7.mlp.down_proj")
    resolution = resolve(builtin_scheme("compressed-tensors/W4A16"), problem, fake_device("sm90"), declarations)
    check_snapshot("no_kernel_unaligned_shape", error_text(resolution, declarations))
    padded = resolve(builtin_scheme("compressed-tensors/W4A16"), problem, fake_device("sm90"), [implemented(MARLIN)])
    assert padded.kernel is not None and padded.kernel.name == "marlin"


def test_device_stage_hint_names_a_device_that_would_work() -> None:
    declarations = [implemented(NATIVE_FP4)]
    resolution = resolve(builtin_scheme("modelopt/NVFP4"), Problem(8192, 8192), fake_device("sm90"), declarations)
    check_snapshot("no_kernel_wrong_device", error_text(resolution, declarations))


def test_rendered_resolution() -> None:
    resolution = resolve(
        builtin_scheme("compressed-tensors/NVFP4"), Problem(4096, 4096), fake_device("sm100"), AS_IF_IMPLEMENTED
    )
    check_snapshot("resolve_nvfp4_sm100", render_resolution(resolution))
    data = resolution_json(resolution)
    assert data["kernel"] == "native_fp4"
    trace: list[dict[str, object]] = data["trace"]  # type: ignore[assignment]
    assert [entry["kernel"] for entry in trace] == BUILTIN_KERNELS_BY_PRIORITY
    assert set(trace[0]) >= {"kernel", "accepted", "stage", "reason"}


def test_activation_formats_no_kernel_takes(tmp_path: Path) -> None:
    """Kernels take the activation's family, granularity and timing but not its element or scale
    formats: the message names the formats, there only."""
    file = tmp_path / "e5m2.yaml"
    file.write_text(E5M2_PER_TOKEN)
    problem = Problem(4096, 4096, layer="model.layers.0.mlp.down_proj")
    resolution = resolve(parse_scheme_file(file), problem, fake_device("sm90"), AS_IF_IMPLEMENTED)
    check_snapshot("no_kernel_activation_formats", error_text(resolution, AS_IF_IMPLEMENTED))
    data = resolution_json(resolution, declarations=AS_IF_IMPLEMENTED)
    assert data["kernel"] is None
    pairings: list[dict[str, object]] = data["pairings"]  # type: ignore[assignment]
    assert {
        "activations": "fp8 dynamic per token (e4m3, fp32/float scales)",
        "kernels": ["native_fp8_rowwise", "dequant_gemm", "triton", "cpu_gemv", "reference", "native_fp8_cpu"],
    } in pairings


@dataclass(frozen=True)
class EvenRows:
    """A plugin's own problem check, with its own hint."""

    def check(self, problem: Problem) -> CheckResult:
        if problem.n % 2 == 0:
            return CheckResult(True)
        return CheckResult(False, f"needs an even N; layer has N={problem.n}", f"add one zero row (N={problem.n + 1})")

    def describe(self) -> str:
        return "N % 2 == 0"


EVEN_ROWS_KERNEL = KernelDeclaration(
    name="even_rows",
    provider="test",
    priority=5,
    supports=(Supports(("int4",), granularities=("group",)),),
    devices=(DeviceSupport("cuda"),),
    implementation="fake_kernels:even_rows",
    checks=(EvenRows(),),
)


def test_plugin_check_hints_show_in_text_as_in_json() -> None:
    problem = Problem(4095, 4096)
    resolution = resolve(builtin_scheme("compressed-tensors/W4A16"), problem, fake_device("cpu"), [EVEN_ROWS_KERNEL])
    text = render_resolution(resolution)
    lines = text.splitlines()
    reason = next(i for i, line in enumerate(lines) if "needs an even N; layer has N=4095" in line)
    assert lines[reason + 1].split() == ["hint:", "add", "one", "zero", "row", "(N=4096)"]
    assert lines[reason].split()[0] == "problem"  # a continuation row: the kernel's name is on the first
    assert any(line.startswith("even_rows ") and "runs on cuda; device is cpu" in line for line in lines)
    data = resolution_json(resolution)
    trace: list[dict[str, object]] = data["trace"]  # type: ignore[assignment]
    assert trace[0]["failures"] == [
        {"stage": "device", "reason": "runs on cuda; device is cpu", "hint": ""},
        {"stage": "problem", "reason": "needs an even N; layer has N=4095", "hint": "add one zero row (N=4096)"},
    ]


def test_every_failing_check_with_a_layout_the_scheme_cannot_store() -> None:
    """NVFP4A16 forced onto Marlin for a 100x100 layer on a CPU without vLLM: the scheme's groups
    of 16 cannot store K=100, and each of Marlin's failing checks has its row (two device rows; the
    shape is none: Marlin pads it to its tiles)."""
    resolution = resolve(
        builtin_scheme("compressed-tensors/NVFP4A16"),
        Problem(100, 100),
        fake_device("cpu", modules=all_modules() - {"vllm"}),
        AS_IF_IMPLEMENTED,
        force="marlin",
    )
    text = render_resolution(resolution, hint=suggest(resolution, AS_IF_IMPLEMENTED, ALTERNATIVE_DEVICES))
    check_snapshot("resolve_every_failing_check", text)
    marlin = resolution.candidate("marlin")
    assert [(f.stage, f.reason) for f in marlin.failures] == [
        ("device", "runs on cuda; device is cpu"),
        ("device", "needs module vllm, not importable here"),
    ]
    assert "layout: scheme compressed-tensors/NVFP4A16 stores layers with K % 16 == 0, not N=100, K=100" in text
    assert text.rstrip().endswith(
        "hint: pad the layer to N=100, K=112 for scheme compressed-tensors/NVFP4A16, "
        "or quantize it with a scheme whose declared shapes round up (ceil(K/d))"
    )
    unforced = resolve(resolution.scheme, resolution.problem, resolution.device, AS_IF_IMPLEMENTED)
    check_snapshot("no_kernel_unstorable_layout", error_text(unforced, AS_IF_IMPLEMENTED))
