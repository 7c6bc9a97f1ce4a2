"""Device facts: probing never raises; simulated devices; the edge that fills modules and variables."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from qscheme.errors import UsageError
from qscheme.kernels import devices
from qscheme.kernels.devices import SIMULATED_DEVICES, device_facts, probe_device, simulated_device, with_environment


@pytest.mark.parametrize(
    ("name", "capability"),
    [
        ("sm75", (7, 5)),
        ("sm80", (8, 0)),
        ("sm86", (8, 6)),
        ("sm89", (8, 9)),
        ("sm90", (9, 0)),
        ("sm100", (10, 0)),
        ("sm103", (10, 3)),
        ("sm120", (12, 0)),
    ],
)
def test_simulated_devices(name: str, capability: tuple[int, int]) -> None:
    facts = device_facts(name)
    assert (facts.type, facts.capability, facts.simulated) == ("cuda", capability, True)
    assert facts.label == f"cuda {name}"
    assert facts.torch_version is not None and "+" not in facts.torch_version  # a CUDA build of the same release
    assert any("checked in the local environment" in note for note in facts.notes)
    assert f"compute capability {capability[0]}.{capability[1]}" in facts.describe()


def test_every_documented_device_name_is_known() -> None:
    assert set(SIMULATED_DEVICES) == {"sm75", "sm80", "sm86", "sm89", "sm90", "sm100", "sm103", "sm120"}
    with pytest.raises(UsageError, match="unknown device 'sm70'"):
        device_facts("sm70")
    with pytest.raises(UsageError, match="unknown simulated device"):
        simulated_device("h100")


def test_probe_is_the_cpu_here_and_reports_versions() -> None:
    facts = probe_device()
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert facts.type == "cpu" and not facts.simulated and facts.capability is None
    assert facts.torch_version and facts.torch_version.startswith("2.")
    assert device_facts("cpu").type == "cpu"


def test_probe_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> bool:
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(torch.cuda, "is_available", broken)
    facts = probe_device()
    assert facts.type == "cpu"
    assert facts.notes == ("probing the GPU failed: RuntimeError: driver exploded",)


def test_cuda_without_a_gpu_is_a_clear_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError, match=r"--device cuda: no GPU is visible here .*--device sm75 \| sm80 \| sm86"):
        device_facts("cuda")


def test_a_probed_gpu_reports_its_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    facts = device_facts("cuda")
    assert (facts.type, facts.name, facts.capability, facts.simulated) == ("cuda", "NVIDIA H200", (9, 0), False)


def test_with_environment_checks_modules_and_variables() -> None:
    facts = with_environment(
        device_facts("sm90"),
        modules=["pluggy", "qscheme_no_such_module", "vllm.nonexistent.sub"],
        variables=["TRITON_INTERPRET", "UNSET_VARIABLE_FOR_TEST"],
        environ={"TRITON_INTERPRET": "1"},
    )
    assert facts.modules == frozenset({"pluggy"})
    assert facts.environment == (("TRITON_INTERPRET", "1"),)
    assert facts.env("TRITON_INTERPRET") == "1" and facts.env("UNSET_VARIABLE_FOR_TEST") is None
    assert devices.module_available("qscheme_no_such_module") is False
    assert facts.as_json()["capability"] == "9.0"


def test_declared_torch_features_are_probed_not_only_a_fixed_list() -> None:
    from qscheme.kernels import registry
    from qscheme.kernels.declaration import ANY_DEVICE, DeviceSupport, KernelDeclaration, Supports
    from qscheme.kernels.resolver import check_device

    declaration = KernelDeclaration(
        "feature_test",
        "test",
        1,
        (Supports(("fp8",)),),
        (DeviceSupport(ANY_DEVICE),),
        "qscheme_plugins.reference_kernel:ReferenceKernel",
        torch_features=("float8_e5m2", "qscheme_no_such_torch_feature"),
    )
    assert "float8_e5m2" not in devices.KNOWN_TORCH_FEATURES and hasattr(torch, "float8_e5m2")
    for name in ("cpu", "sm90"):
        facts = registry.complete_facts(device_facts(name), [declaration])
        assert "float8_e5m2" in facts.torch_features
        assert "qscheme_no_such_torch_feature" not in facts.torch_features
        assert check_device(declaration, facts) == (
            f"needs torch.qscheme_no_such_torch_feature, which torch {facts.torch_version} lacks"
        )


def test_simulated_devices_report_the_known_features_of_the_local_torch() -> None:
    expected = {name for name in devices.KNOWN_TORCH_FEATURES if hasattr(torch, name)}
    assert simulated_device("sm100").torch_features == expected
    assert device_facts("sm100").torch_features == expected


def test_a_plugin_kernel_needing_a_torch_feature_torch_has_is_chosen() -> None:
    from kernel_fakes import builtin_scheme, isolated_plugins

    from qscheme.kernels import registry
    from qscheme.kernels.declaration import ANY_DEVICE, DeviceSupport, KernelDeclaration, Supports
    from qscheme.kernels.problem import Problem
    from qscheme.plugins import hookimpl, register_plugin

    declaration = KernelDeclaration(
        "e5m2_feature_test",
        "test",
        1000,
        (Supports(("int4",)),),
        (DeviceSupport(ANY_DEVICE),),
        "qscheme_plugins.reference_kernel:ReferenceKernel",
        torch_features=("float8_e5m2",),
    )

    class FeaturePlugin:
        @hookimpl
        def qscheme_kernels(self) -> list[KernelDeclaration]:
            return [declaration]

    with isolated_plugins():
        register_plugin(FeaturePlugin(), "feature-plugin")
        for name in ("cpu", "sm90"):
            resolution = registry.resolve_layer(
                builtin_scheme("compressed-tensors/W4A16"), Problem(256, 512), name, environ={}
            )
            assert resolution.kernel is not None and resolution.kernel.name == "e5m2_feature_test"


def test_turing_can_be_simulated() -> None:
    facts = device_facts("sm75")
    assert facts.name == "simulated sm75, Turing (T4-class)" and facts.capability == (7, 5)


# --- the torch build (DeviceFacts.torch_build) -------------------------------------------------------


def test_the_probe_reports_the_local_torch_build() -> None:
    if torch.version.cuda or getattr(torch.version, "hip", None):
        pytest.skip("this torch is a CUDA or ROCm build")
    facts = probe_device()
    assert facts.torch_build == "cpu" and facts.cpu_only_torch
    assert device_facts("cpu").torch_build == "cpu"
    assert facts.as_json()["torch_build"] == "cpu"


def test_a_probed_cuda_build_reports_its_cuda_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.version, "hip", None)
    facts = probe_device()
    assert facts.torch_build == "cuda 12.8" and not facts.cpu_only_torch


def test_simulated_devices_assume_a_cuda_build_unless_told() -> None:
    for facts in (simulated_device("sm90"), device_facts("sm90")):
        assert facts.torch_build == "cuda (assumed)" and not facts.cpu_only_torch
    cpu_only = simulated_device("sm90", torch_build="cpu")
    assert cpu_only.torch_build == "cpu" and cpu_only.cpu_only_torch
    assert cpu_only.capability == (9, 0) and cpu_only.simulated


def test_a_cpu_only_torch_build_rejects_the_kernels_placed_on_cuda() -> None:
    from kernel_fakes import builtin_scheme, isolated_plugins

    from qscheme.kernels import registry
    from qscheme.kernels.problem import Problem

    cpu_only_build = "torch 2.13.0 here is a CPU-only build: it has no cuda kernels (install a CUDA build of torch)"
    scheme = builtin_scheme("compressed-tensors/W4A16")
    with isolated_plugins():
        for build, expected in (("cuda (assumed)", "tinygemm"), ("cpu", "reference")):
            facts = registry.complete_facts(simulated_device("sm90", torch_build=build))
            facts = replace(facts, torch_version="2.13.0")  # the message names the version: keep it fixed
            resolution = registry.resolve_layer(scheme, Problem(256, 512), facts, environ={})
            assert resolution.kernel is not None and resolution.kernel.name == expected, resolution.trace
            for name in ("triton", "tinygemm"):
                candidate = resolution.candidate(name)
                if build == "cpu":
                    assert not candidate.accepted and candidate.stage == "device"
                    assert [f.reason for f in candidate.failures if f.stage == "device"] == [cpu_only_build]
                else:
                    assert cpu_only_build not in candidate.reason
            # the reference kernel runs on any device: a CPU-only build does not reject it
            reference = resolution.candidate("reference")
            assert reference.accepted and all(f.stage != "device" for f in reference.failures)
            # kernels placed on the CPU are rejected for the placement, not the build
            assert resolution.candidate("tinygemm_cpu").reason == "runs on cpu; device is cuda"


# --- torch_features: attributes, dotted paths and operators ------------------------------------------


def test_dotted_torch_features_and_operators_are_probed() -> None:
    from qscheme.kernels import registry
    from qscheme.kernels.declaration import ANY_DEVICE, DeviceSupport, KernelDeclaration, Supports
    from qscheme.kernels.resolver import check_device

    present = ("nn.functional.linear", "ops.aten.mm", "ops.aten._weight_int4pack_mm_for_cpu")
    missing = ("ops.aten.no_such_op", "nn.functional.no_such_function", "nn.no_such_module.linear")
    declaration = KernelDeclaration(
        "dotted_feature_test",
        "test",
        1,
        (Supports(("int4",)),),
        (DeviceSupport(ANY_DEVICE),),
        "qscheme_plugins.reference_kernel:ReferenceKernel",
        torch_features=(*present, *missing),
    )
    for name in ("cpu", "sm90"):
        facts = registry.complete_facts(device_facts(name), [declaration])
        assert set(present) <= facts.torch_features
        assert not set(missing) & facts.torch_features
        assert check_device(declaration, facts) == (
            "needs torch.ops.aten.no_such_op, torch.nn.functional.no_such_function, torch.nn.no_such_module.linear, "
            f"which torch {facts.torch_version} lacks"
        )
