"""The registry: resolution imports the code of the kernel it reports, once per process, and
rejects kernels whose code cannot be used; ``kernel=`` arguments are checked up front."""

from __future__ import annotations

import importlib
import re
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
from kernel_fakes import builtin_scheme, isolated_plugins
from qscheme_plugins.reference import REFERENCE
from qscheme_plugins.triton_declaration import TRITON

from qscheme.errors import NoKernelError, UsageError
from qscheme.kernels import registry
from qscheme.kernels.declaration import KernelDeclaration
from qscheme.kernels.problem import Problem
from qscheme.plugins import hookimpl, register_plugin

SCHEME = "compressed-tensors/W4A16"
PROBLEM = Problem(256, 512)
NO_TRITON = {"QSCHEME_DISABLED_KERNELS": "triton"}


def _package(folder: Path, name: str) -> None:
    """A kernel package in three broken ways (plus one working kernel), importable from ``folder``."""
    package = folder / name
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "needs_library.py").write_text(
        textwrap.dedent(
            """
            import qscheme_test_library_that_is_not_installed

            class Kernel:
                def prepare(self, weight, device): ...
                def apply(self, state, x, bias): ...
            """
        )
    )
    (package / "kernels.py").write_text(
        textwrap.dedent(
            """
            from qscheme_plugins.reference_kernel import ReferenceKernel as Working

            class PrepareOnly:
                def prepare(self, weight, device): ...
            """
        )
    )


def _declarations(package: str) -> list[KernelDeclaration]:
    broken = {
        "needs_library": (f"{package}.needs_library:Kernel", 400),
        "missing_class": (f"{package}.kernels:NoSuchKernel", 300),
        "prepare_only": (f"{package}.kernels:PrepareOnly", 200),
        "working": (f"{package}.kernels:Working", 100),
    }
    return [replace(REFERENCE, name=n, implementation=ref, priority=p) for n, (ref, p) in broken.items()]


class _Plugin:
    def __init__(self, declarations: list[KernelDeclaration]) -> None:
        self.declarations = declarations

    @hookimpl
    def qscheme_kernels(self) -> list[KernelDeclaration]:
        return self.declarations


@pytest.fixture
def broken_kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    name = "qscheme_test_kernels_" + re.sub(r"\W", "_", request.node.name)
    _package(tmp_path, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    with isolated_plugins():
        register_plugin(_Plugin(_declarations(name)), "test-kernels")
        yield name
    for module in [m for m in sys.modules if m.startswith(name)]:
        del sys.modules[module]


REASONS = {
    "needs_library": "ModuleNotFoundError: No module named 'qscheme_test_library_that_is_not_installed'",
    "missing_class": "AttributeError: {package}.kernels has no attribute 'NoSuchKernel'",
    "prepare_only": "TypeError: {package}.kernels:PrepareOnly does not implement the kernel interface: no apply method",
}


def test_resolution_rejects_each_kernel_whose_code_fails_with_the_import_error(broken_kernels: str) -> None:
    resolution = registry.resolve_layer(builtin_scheme(SCHEME), PROBLEM, "cpu", environ=NO_TRITON)
    assert resolution.kernel is not None and resolution.kernel.name == "working"
    for name, reason in REASONS.items():
        candidate = resolution.candidate(name)
        assert not candidate.accepted and candidate.stage == "device"
        assert f"failed to load: {reason.format(package=broken_kernels)}" in candidate.reason
    assert set(registry.implementation_failures()) == set(REASONS)
    assert [u["kernel"] for u in registry.unavailable_kernels()] == list(REASONS)  # priority order
    assert registry.unavailable_lines()[1].startswith("  needs_library (plugin test-kernels): ModuleNotFoundError")
    # what the layer runs is what was reported
    _, declaration, implementation = registry.select_kernel(builtin_scheme(SCHEME), PROBLEM, "cpu", environ=NO_TRITON)
    assert declaration is resolution.kernel and type(implementation).__name__ == "ReferenceKernel"


def test_each_implementation_is_imported_once_per_process(broken_kernels: str, monkeypatch: pytest.MonkeyPatch) -> None:
    imported: list[str] = []
    real = importlib.import_module

    def counting(name: str, package: str | None = None) -> object:
        imported.append(name)
        return real(name, package)

    monkeypatch.setattr(registry.importlib, "import_module", counting)
    scheme = builtin_scheme(SCHEME)
    for n in (256, 512, 256, 1024):
        assert registry.resolve_layer(scheme, Problem(n, 512), "cpu", environ=NO_TRITON).kernel.name == "working"  # type: ignore[union-attr]
    registry.select_kernel(scheme, PROBLEM, "cpu", environ=NO_TRITON)
    ours = [name for name in imported if name.startswith(broken_kernels)]
    # needs_library, kernels (missing class), kernels (prepare only), kernels (working): one attempt each
    assert sorted(ours) == sorted([f"{broken_kernels}.needs_library", *[f"{broken_kernels}.kernels"] * 3])


def test_a_forced_kernel_whose_code_fails_leaves_the_layer_without_a_kernel(broken_kernels: str) -> None:
    scheme = builtin_scheme(SCHEME)
    resolution = registry.resolve_layer(scheme, PROBLEM, "cpu", "prepare_only", environ=NO_TRITON)
    assert resolution.kernel is None
    # the other accepted kernels were imported too: the hint offers only one whose code works
    assert not resolution.candidate("needs_library").accepted and resolution.candidate("working").accepted
    with pytest.raises(NoKernelError) as caught:
        registry.select_kernel(scheme, PROBLEM, "cpu", "prepare_only", environ=NO_TRITON)
    message = str(caught.value)
    assert "forced kernel 'prepare_only' cannot run" in message
    assert REASONS["prepare_only"].format(package=broken_kernels) in message
    assert "hint: kernel working can run this layer here" in message


def test_the_builtin_triton_kernel_is_never_chosen_when_its_code_fails_to_import(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = TRITON.implementation_module
    assert module is not None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(sys.modules, module, None)  # `import` of it now raises (ModuleNotFoundError)
    # tinygemm_cpu (60) outranks triton (50) for int4 with bf16 inputs on a CPU: without it, triton
    # is the kernel resolution would choose, so its code is what gets imported (cpu_gemv, 45, is
    # disabled too: the reference kernel is what remains when triton's code fails)
    no_tinygemm = {"QSCHEME_DISABLED_KERNELS": "tinygemm_cpu,cpu_gemv"}
    with isolated_plugins():
        resolution = registry.resolve_layer(builtin_scheme(SCHEME), PROBLEM, "cpu", environ=no_tinygemm)
        assert resolution.kernel is not None and resolution.kernel.name == "reference"
        rejected = resolution.candidate("triton")
        assert rejected.stage == "device" and f"ModuleNotFoundError: import of {module} halted" in rejected.reason
        failures = registry.verified_failures(registry.declarations(), registry.device_for("cpu"))
        assert set(failures) == {"triton"}
    with isolated_plugins():  # a fresh process (reset) imports it again, and it works
        monkeypatch.delitem(sys.modules, module)
        again = registry.resolve_layer(builtin_scheme(SCHEME), PROBLEM, "cpu", environ=no_tinygemm)
        assert again.kernel is not None and again.kernel.name == "triton"


def test_kernels_lists_a_kernel_as_available_only_when_its_code_imports(
    broken_kernels: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from qscheme.cli.main import main

    assert main(["kernels", "--device", "cpu", "--json"]) == 0
    records = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    for name, reason in REASONS.items():
        assert records[name]["available"] is False
        assert reason.format(package=broken_kernels) in records[name]["reason"]
    assert records["working"]["available"] is True and records["working"]["reason"] is None
    # a kernel the device rejects anyway is not imported just to list it
    assert "marlin" not in registry.implementation_failures()


@pytest.mark.parametrize(
    ("kernel", "message"),
    [
        (REFERENCE, r"kernel= takes a kernel's name \(str\), not a KernelDeclaration; e\.g\. kernel='reference'"),
        (3, r"kernel= takes a kernel's name \(str\), not a int; e\.g\. kernel='triton'"),
        ("", r"an empty kernel name"),
        (
            "refrence",
            r"unknown kernel 'refrence' was forced\. Did you mean 'reference'\? "
            r"Known kernels: cpu_gemm_blocks, cpu_gemv, cpu_gemv_blocks, cpu_gemv_blocks_bf16, cpu_int8_gemm, "
            r"dequant_gemm",
        ),
    ],
)
def test_a_kernel_argument_must_name_a_declared_kernel(kernel: object, message: str) -> None:
    with isolated_plugins():
        with pytest.raises(UsageError, match=rf"^caller\(kernel=.*\): {message}"):
            registry.checked_kernel(kernel, "caller")
        assert registry.checked_kernel("triton", "caller") == "triton"
        assert registry.checked_kernel(None, "caller") is None
