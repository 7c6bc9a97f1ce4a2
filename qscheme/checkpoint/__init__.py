"""Loading quantized checkpoints exactly: detect, read, validate, canonicalise, fuse, build.

See docs/checkpoints.md. The public entry points are ``load_checkpoint`` and ``apply_to_model``.
Names are imported on first use, so that importing this package (e.g. for the command line's
argument parser) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qscheme.checkpoint.config import NoQuantization, ProducerConfig, read_producer_config
    from qscheme.checkpoint.detect import Detection, ModuleAssignment, detect
    from qscheme.checkpoint.fuse import FUSE_POLICIES, FuseOutcome, fuse_members
    from qscheme.checkpoint.inspect import Inspection, inspect_checkpoint
    from qscheme.checkpoint.load import Checkpoint, UnknownModuleError, load_checkpoint
    from qscheme.checkpoint.model import apply_to_model
    from qscheme.checkpoint.plan import FuseGroup, Plan, plan_checkpoint
    from qscheme.checkpoint.report import CheckpointReport, LayerReport
    from qscheme.checkpoint.resolve import resolve_checkpoint
    from qscheme.producers.compressed_tensors import CompressedTensorsConfig
    from qscheme.producers.modelopt import ModeloptConfig
    from qscheme.storage import CheckpointFiles, TensorInfo

_EXPORTS: dict[str, str] = {
    "CompressedTensorsConfig": "qscheme.producers.compressed_tensors",
    "ModeloptConfig": "qscheme.producers.modelopt",
    "NoQuantization": "config",
    "ProducerConfig": "config",
    "read_producer_config": "config",
    "Detection": "detect",
    "ModuleAssignment": "detect",
    "detect": "detect",
    "FUSE_POLICIES": "fuse",
    "FuseOutcome": "fuse",
    "fuse_members": "fuse",
    "Inspection": "inspect",
    "inspect_checkpoint": "inspect",
    "Checkpoint": "load",
    "load_checkpoint": "load",
    "UnknownModuleError": "load",
    "apply_to_model": "model",
    "FuseGroup": "plan",
    "Plan": "plan",
    "plan_checkpoint": "plan",
    "CheckpointFiles": "qscheme.storage",
    "TensorInfo": "qscheme.storage",
    "CheckpointReport": "report",
    "LayerReport": "report",
    "resolve_checkpoint": "resolve",
}

__all__ = [
    "FUSE_POLICIES",
    "Checkpoint",
    "CheckpointFiles",
    "CheckpointReport",
    "CompressedTensorsConfig",
    "Detection",
    "FuseGroup",
    "FuseOutcome",
    "Inspection",
    "LayerReport",
    "ModeloptConfig",
    "ModuleAssignment",
    "NoQuantization",
    "Plan",
    "ProducerConfig",
    "TensorInfo",
    "UnknownModuleError",
    "apply_to_model",
    "detect",
    "fuse_members",
    "inspect_checkpoint",
    "load_checkpoint",
    "plan_checkpoint",
    "read_producer_config",
    "resolve_checkpoint",
]


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'qscheme.checkpoint' has no attribute {name!r}")
    # A dotted value is a module elsewhere (the safetensors files are qscheme.storage's).
    return getattr(importlib.import_module(module if "." in module else f"qscheme.checkpoint.{module}"), name)
