"""Scheme descriptors: the YAML schema, its parser and the parsed dataclasses."""

from __future__ import annotations

from qscheme.descriptor.model import (
    ActivationSpec,
    DetectSpec,
    FusedSpec,
    GlobalScaleSpec,
    ScaleSpec,
    Scheme,
    TensorSpec,
    WeightSpec,
    ZeroPointSpec,
)
from qscheme.descriptor.parse import parse_scheme_file, parse_scheme_text

__all__ = [
    "ActivationSpec",
    "DetectSpec",
    "FusedSpec",
    "GlobalScaleSpec",
    "ScaleSpec",
    "Scheme",
    "TensorSpec",
    "WeightSpec",
    "ZeroPointSpec",
    "parse_scheme_file",
    "parse_scheme_text",
]
