"""Device facts: the device this process would run on, or a simulated one.

``probe_device`` never raises: whatever goes wrong while asking torch becomes a note and a
CPU device. ``simulated_device("sm90")`` describes a GPU this machine does not have, assuming
a CUDA build of the local torch version; optional kernel libraries (vllm, sgl-kernel,
flashinfer) are still checked in the local environment, and the facts say so.

The resolver only ever sees ``DeviceFacts``; which modules are importable, which environment
variables are set and which ``torch`` attributes the declared kernels need are filled in here,
at the edge (``with_environment``).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from functools import cache
from importlib import metadata

from qscheme.errors import UsageError
from qscheme.kernels.declaration import Capability, format_capability

SIMULATED_DEVICES: dict[str, tuple[Capability, str]] = {
    "sm75": ((7, 5), "Turing (T4-class)"),
    "sm80": ((8, 0), "Ampere datacenter (A100-class)"),
    "sm86": ((8, 6), "Ampere consumer (RTX 30-class)"),
    "sm89": ((8, 9), "Ada (L40 / RTX 40-class)"),
    "sm90": ((9, 0), "Hopper (H100-class)"),
    "sm100": ((10, 0), "Blackwell datacenter (B200-class)"),
    "sm103": ((10, 3), "Blackwell Ultra (B300-class)"),
    "sm120": ((12, 0), "Blackwell consumer (RTX 50-class)"),
}
DEVICE_CHOICES: tuple[str, ...] = ("cpu", "cuda", *SIMULATED_DEVICES)


@dataclass(frozen=True)
class DeviceFacts:
    """What the resolver may know about a device and the software around it."""

    type: str
    name: str
    capability: Capability | None = None
    torch_version: str | None = None
    triton_version: str | None = None
    simulated: bool = False
    torch_features: frozenset[str] = frozenset()
    modules: frozenset[str] = frozenset()
    environment: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()
    torch_build: str | None = None
    distributions: tuple[tuple[str, str], ...] = ()

    def distribution_version(self, name: str) -> str | None:
        """The installed version of a distribution the declarations asked about (None: not installed)."""
        for key, value in self.distributions:
            if key == name:
                return value
        return None

    @property
    def cpu_only_torch(self) -> bool:
        """Whether the torch these facts describe is a CPU-only build (no CUDA or ROCm kernels)."""
        return self.torch_build == "cpu"

    @property
    def label(self) -> str:
        """``cuda sm90`` style short name used in tables and hints."""
        if self.type == "cuda" and self.capability is not None:
            return f"cuda sm{self.capability[0]}{self.capability[1]}"
        return self.type

    def env(self, name: str) -> str | None:
        for key, value in self.environment:
            if key == name:
                return value
        return None

    def describe(self) -> str:
        """One line: type, name, compute capability, versions, simulated or probed."""
        parts = [self.type if self.name == self.type else f"{self.type} ({self.name})"]
        if self.capability is not None:
            parts.append(f"compute capability {format_capability(self.capability)}")
        parts.append(f"torch {self.torch_version or 'not installed'}")
        parts.append(f"triton {self.triton_version or 'not installed'}")
        text = ", ".join(parts)
        return f"{text}; simulated" if self.simulated else text

    def as_json(self) -> dict[str, object]:
        return {
            "type": self.type,
            "name": self.name,
            "capability": format_capability(self.capability) if self.capability else None,
            "torch_version": self.torch_version,
            "triton_version": self.triton_version,
            "simulated": self.simulated,
            "torch_features": sorted(self.torch_features),
            "modules": sorted(self.modules),
            "environment": dict(self.environment),
            "notes": list(self.notes),
            "torch_build": self.torch_build,
            "distributions": dict(self.distributions),
        }


@cache
def _distribution_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except Exception:
        return None


@cache
def module_available(name: str) -> bool:
    """Whether ``import name`` would find the module (nothing is imported; never raises)."""
    try:
        return importlib.util.find_spec(name) is not None
    except Exception:
        return False


def _has_path(root: object, dotted: str) -> bool:
    """Whether ``root.a.b.c`` exists for ``dotted`` = ``a.b.c`` (never raises)."""
    value = root
    for part in dotted.split("."):
        try:
            value = getattr(value, part)
        except Exception:
            return False
    return True


def _torch_features(names: Iterable[str]) -> frozenset[str]:
    """Which of the names exist in the local torch: attributes of the ``torch`` module, dotted
    paths below it (``nn.functional.scaled_mm``) or operators (``ops.aten._weight_int4pack_mm``)."""
    try:
        import torch
    except Exception:
        return frozenset()
    return frozenset(name for name in names if _has_path(torch, name))


def _local_torch_build() -> str | None:
    """``cpu``, ``cuda 12.8`` or ``rocm 6.4`` for the local torch; None without torch."""
    try:
        import torch
    except Exception:
        return None
    hip = getattr(torch.version, "hip", None)
    if hip:
        return f"rocm {hip}"
    cuda = getattr(torch.version, "cuda", None)
    return f"cuda {cuda}" if cuda else "cpu"


# Probed for every device (and shown by `qscheme kernels --json`); the features a declaration
# names are probed as well, by with_environment.
KNOWN_TORCH_FEATURES: tuple[str, ...] = ("float4_e2m1fn_x2", "float8_e4m3fn", "float8_e8m0fnu", "_scaled_mm")


def _local_torch_version() -> str | None:
    return _distribution_version("torch")


def probe_device(index: int = 0) -> DeviceFacts:
    """The device torch would use here. Never raises: problems become notes on a CPU device."""
    torch_version = _local_torch_version()
    triton_version = _distribution_version("triton")
    features = _torch_features(KNOWN_TORCH_FEATURES)
    build = _local_torch_build()
    notes: list[str] = []
    try:
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(index)
            if getattr(torch.version, "hip", None):
                return DeviceFacts(
                    "rocm", name, None, torch_version, triton_version, False, features, torch_build=build
                )
            major, minor = torch.cuda.get_device_capability(index)
            capability = (int(major), int(minor))
            return DeviceFacts(
                "cuda", name, capability, torch_version, triton_version, False, features, torch_build=build
            )
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return DeviceFacts(
                "mps", "Apple GPU", None, torch_version, triton_version, False, features, torch_build=build
            )
    except Exception as exc:  # a broken driver must not break resolution: report it
        notes.append(f"probing the GPU failed: {type(exc).__name__}: {exc}")
    return DeviceFacts(
        "cpu", "cpu", None, torch_version, triton_version, False, features, notes=tuple(notes), torch_build=build
    )


def simulated_device(name: str, torch_build: str = "cuda (assumed)") -> DeviceFacts:
    """A CUDA device this machine may not have, e.g. ``sm100``; UsageError for unknown names.

    The facts assume a CUDA build of the local torch release (``torch_build``); pass
    ``torch_build="cpu"`` to judge the kernels as the local CPU-only build would run them there
    (every kernel placed on cuda is then rejected with that reason)."""
    if name not in SIMULATED_DEVICES:
        raise UsageError(f"unknown simulated device {name!r}; choose one of {', '.join(SIMULATED_DEVICES)}")
    capability, family = SIMULATED_DEVICES[name]
    local = _local_torch_version()
    torch_version = local.split("+", 1)[0] if local else None  # a CUDA build of the same release
    return DeviceFacts(
        "cuda",
        f"simulated {name}, {family}",
        capability,
        torch_version,
        _distribution_version("triton"),
        True,
        _torch_features(KNOWN_TORCH_FEATURES),
        notes=(
            f"simulated: assumes a CUDA build of the local torch {torch_version or '(not installed)'}",
            "optional kernel libraries (vllm, sgl-kernel, flashinfer) are checked in the local environment",
        ),
        torch_build=torch_build,
    )


def device_facts(name: str | None = None) -> DeviceFacts:
    """``None``/``"auto"``: probe; ``"cpu"``; ``"cuda"``: the real GPU or UsageError; ``"smXY"``."""
    if name in (None, "auto"):
        return probe_device()
    if name == "cpu":
        probed = probe_device()
        if probed.type == "cpu":
            return probed
        return DeviceFacts(
            "cpu",
            "cpu",
            None,
            probed.torch_version,
            probed.triton_version,
            False,
            probed.torch_features,
            torch_build=probed.torch_build,
        )
    if name == "cuda":
        probed = probe_device()
        if probed.type in ("cuda", "rocm"):
            return probed
        reason = "; ".join(probed.notes) or f"torch {probed.torch_version or '(not installed)'} sees no CUDA device"
        raise UsageError(
            f"--device cuda: no GPU is visible here ({reason}). Simulate one instead: "
            f"--device {' | '.join(SIMULATED_DEVICES)}"
        )
    if name in SIMULATED_DEVICES:
        return simulated_device(name)
    raise UsageError(f"unknown device {name!r}; choose one of {', '.join(DEVICE_CHOICES)}")


def with_environment(
    facts: DeviceFacts,
    modules: Iterable[str] = (),
    variables: Iterable[str] = (),
    environ: Mapping[str, str] | None = None,
    torch_features: Iterable[str] = (),
    distributions: Iterable[str] = (),
) -> DeviceFacts:
    """The facts plus which of ``modules`` are importable, the values of ``variables``, which
    of ``torch_features`` the local torch has (a simulated device assumes the same torch) and
    the installed versions of ``distributions`` (from package metadata; nothing is imported)."""
    env = os.environ if environ is None else environ
    found = frozenset(m for m in modules if module_available(m))
    values = tuple(sorted((v, env[v]) for v in set(variables) if v in env))
    features = facts.torch_features
    wanted = set(torch_features) - features
    if wanted:  # only then is torch imported
        features = features | _torch_features(sorted(wanted))
    versions = dict(facts.distributions)
    for name in distributions:
        if name not in versions:
            version = _distribution_version(name)
            if version is not None:
                versions[name] = version
    return replace(
        facts,
        modules=facts.modules | found,
        environment=values,
        torch_features=features,
        distributions=tuple(sorted(versions.items())),
    )
