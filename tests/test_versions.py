"""qscheme.kernels.versions and KernelDeclaration.requires_versions: a kernel library's version
range as data, judged at the resolver's device stage."""

from __future__ import annotations

from dataclasses import replace

import pytest
from kernel_fakes import builtin_scheme, fake_device

from qscheme.kernels.declaration import DeviceSupport, KernelDeclaration, Supports
from qscheme.kernels.devices import with_environment
from qscheme.kernels.problem import Problem
from qscheme.kernels.resolver import resolve
from qscheme.kernels.versions import parse_specifier, release, satisfies


@pytest.mark.parametrize(
    ("version", "specifier", "inside"),
    [
        ("0.33.0", ">=0.33,<0.34", True),
        ("0.33.2rc1.dev7+cu128", ">=0.33,<0.34", True),
        ("0.34.0", ">=0.33,<0.34", False),
        ("0.32.9", ">=0.33,<0.34", False),
        ("0.33", "==0.33.0", True),
        ("1.0", "!=1.0.0", False),
        ("2.13.0+cpu", ">2.12", True),
        ("2.13.0", "<=2.13", True),
        ("nightly", ">=0", False),
    ],
)
def test_satisfies(version: str, specifier: str, inside: bool) -> None:
    assert satisfies(version, specifier) is inside


def test_release_and_bad_specifiers() -> None:
    assert release("v0.33.1.post2") == (0, 33, 1)
    assert release("main") is None
    assert parse_specifier(">=0.33, <0.34") == ((">=", (0, 33)), ("<", (0, 34)))
    for bad in ("~=0.33", ">=0.33,", "0.33", ">=x"):
        with pytest.raises(ValueError, match="is not OP VERSION"):
            parse_specifier(bad)


def kernel(**changes: object) -> KernelDeclaration:
    base = KernelDeclaration(
        name="versioned",
        provider="test",
        priority=500,
        supports=(Supports(weights=("int4",), zero_points=True, per_partition_scales=True, input_pre_scale=True),),
        devices=(DeviceSupport("cpu"),),
        implementation="qscheme_plugins.reference_kernel:ReferenceKernel",
        requires_modules=("somelib",),
        requires_versions=(("somelib", ">=0.33,<0.34"),),
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def test_declarations_refuse_malformed_version_ranges() -> None:
    with pytest.raises(ValueError, match="requires_versions must be a tuple of"):
        kernel(requires_versions=("somelib>=0.33",))
    with pytest.raises(ValueError, match=r"requires_versions somelib: version clause '~=0\.33'"):
        kernel(requires_versions=(("somelib", "~=0.33"),))
    assert kernel().as_json()["requires_versions"] == ["somelib >=0.33,<0.34"]


@pytest.mark.parametrize(
    ("installed", "reason"),
    [
        ("0.33.1", None),
        ("0.35.0", "needs somelib >=0.33,<0.34; somelib 0.35.0 is installed"),
        (None, "needs somelib >=0.33,<0.34; no installed somelib distribution was found"),
    ],
)
def test_the_device_stage_judges_the_installed_version(installed: str | None, reason: str | None) -> None:
    device = fake_device("cpu", modules=frozenset({"somelib", "qscheme_plugins.reference_kernel"}))
    if installed is not None:
        device = replace(device, distributions=(("somelib", installed),))
    resolution = resolve(builtin_scheme("compressed-tensors/W4A16"), Problem(256, 256), device, [kernel()])
    candidate = resolution.candidate("versioned")
    if reason is None:
        assert candidate.accepted and resolution.kernel is not None
    else:
        assert not candidate.accepted and candidate.stage == "device"
        assert candidate.reason == reason


def test_a_missing_module_is_said_once() -> None:
    device = fake_device("cpu", modules=frozenset({"qscheme_plugins.reference_kernel"}))
    candidate = resolve(builtin_scheme("compressed-tensors/W4A16"), Problem(256, 256), device, [kernel()]).candidate(
        "versioned"
    )
    assert candidate.reason == "needs module somelib, not importable here"


def test_with_environment_reads_installed_versions_from_metadata() -> None:
    facts = with_environment(fake_device("cpu"), distributions=("torch", "no-such-distribution-qscheme"))
    versions = dict(facts.distributions)
    assert release(versions["torch"])[:2] == (2, 13)  # type: ignore[index]
    assert "no-such-distribution-qscheme" not in versions
