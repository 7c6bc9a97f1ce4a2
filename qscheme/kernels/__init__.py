"""Kernels: declarations (data), device facts, the resolver, and the implementation interface.

Everything re-exported here imports nothing heavy (no torch); the implementation protocol is
``qscheme.kernels.interface.KernelImplementation`` and the plugin edge is ``registry``.
"""

from __future__ import annotations

from qscheme.kernels.declaration import (
    ANY_DEVICE,
    WEIGHT_ONLY,
    ActivationDtypes,
    ActivationSupport,
    BatchRange,
    CapabilityRange,
    CheckResult,
    DeviceSupport,
    KernelDeclaration,
    ProblemCheck,
    ShapeAlignment,
    Supports,
    WeightBits,
    WeightFormats,
)
from qscheme.kernels.devices import DeviceFacts, device_facts, probe_device, simulated_device
from qscheme.kernels.problem import Problem
from qscheme.kernels.resolver import Candidate, Resolution, Resolver, resolve

__all__ = [
    "ANY_DEVICE",
    "WEIGHT_ONLY",
    "ActivationDtypes",
    "ActivationSupport",
    "BatchRange",
    "Candidate",
    "CapabilityRange",
    "CheckResult",
    "DeviceFacts",
    "DeviceSupport",
    "KernelDeclaration",
    "Problem",
    "ProblemCheck",
    "Resolution",
    "Resolver",
    "ShapeAlignment",
    "Supports",
    "WeightBits",
    "WeightFormats",
    "device_facts",
    "probe_device",
    "resolve",
    "simulated_device",
]
