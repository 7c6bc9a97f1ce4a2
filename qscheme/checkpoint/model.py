"""``apply_to_model``: put a checkpoint into a torch model built from its config.

Every quantized module of the checkpoint replaces the model's ``nn.Linear`` of the same name
(shapes must agree); every plain tensor is loaded into the model's state dict. Strict by
default: a checkpoint module or tensor the model lacks, or a model parameter the checkpoint
does not provide, raises CheckpointError (tied weights, such as an lm_head tied to the
embeddings, count as provided).
"""

from __future__ import annotations

from pathlib import Path

import torch

from qscheme.checkpoint.load import Checkpoint, FusePolicyChoice, load_checkpoint
from qscheme.checkpoint.plan import FuseSpec
from qscheme.errors import CheckpointError

_ACTIVATION_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _model_device_and_dtype(model: torch.nn.Module) -> tuple[torch.device, str]:
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.device, _ACTIVATION_DTYPES.get(parameter.dtype, "bfloat16")
    return torch.device("cpu"), "bfloat16"


def _replace(model: torch.nn.Module, name: str, layer: torch.nn.Module, path: Path) -> None:
    parent_name, _, child = name.rpartition(".")
    try:
        target = model.get_submodule(name)
        parent = model.get_submodule(parent_name) if parent_name else model
    except AttributeError:
        raise CheckpointError(
            f"{path}: the model has no module {name!r} for the checkpoint's quantized layer; build the model "
            "from the checkpoint's config.json (fused modules need a model with fused layers)"
        ) from None
    n = getattr(layer, "out_features", None)
    k = getattr(layer, "in_features", None)
    if not isinstance(target, torch.nn.Linear):
        raise CheckpointError(f"{path}: model module {name!r} is a {type(target).__name__}, not an nn.Linear")
    if (target.out_features, target.in_features) != (n, k):
        raise CheckpointError(
            f"{path}: module {name!r}: the model's Linear is [{target.out_features}, {target.in_features}] but the "
            f"checkpoint's weight is [{n}, {k}]"
        )
    if (target.bias is not None) != (getattr(layer, "bias", None) is not None):
        raise CheckpointError(
            f"{path}: module {name!r}: the model's Linear {'has' if target.bias is not None else 'has no'} bias "
            "but the checkpoint disagrees"
        )
    setattr(parent, child, layer)


def apply_to_model(
    model: torch.nn.Module,
    path: str | Path,
    *,
    device: str | torch.device | None = None,
    kernel: str | None = None,
    fuse: FuseSpec | None = None,
    fuse_policy: FusePolicyChoice = None,
    strict: bool = True,
    progress: bool | None = None,
) -> Checkpoint:
    """Replace the model's matching nn.Linear modules with QuantLinear and load the rest.

    ``device`` defaults to the model's; the kernels are resolved for the model's dtype.
    Returns the loaded Checkpoint (its ``report`` says what was done).
    """
    model_device, activation_dtype = _model_device_and_dtype(model)
    torch_device = torch.device(device) if device is not None else model_device
    checkpoint = load_checkpoint(
        path,
        device=torch_device,
        kernel=kernel,
        fuse=fuse,
        fuse_policy=fuse_policy,
        activation_dtype=activation_dtype,
        progress=progress,
    )
    folder = Path(path)
    for name, layer in checkpoint.items():
        _replace(model, name, layer, folder)
    kv_cache = set(checkpoint.report.kv_cache_tensors)
    state = {name: value for name, value in checkpoint.tensors.items() if name not in kv_cache}
    expected = model.state_dict(keep_vars=True)
    unexpected = sorted(set(state) - set(expected))
    if unexpected and strict:
        raise CheckpointError(
            f"{folder}: the checkpoint has tensors the model lacks: {', '.join(unexpected[:5])}"
            + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else "")
            + "; build the model from the checkpoint's config.json, or pass strict=False"
        )
    for name in unexpected:
        state.pop(name)
    with torch.no_grad():
        for name, value in state.items():
            target = expected[name]
            if tuple(target.shape) != tuple(value.shape):
                raise CheckpointError(
                    f"{folder}: tensor {name!r} is {list(value.shape)} in the checkpoint but {list(target.shape)} "
                    "in the model"
                )
            target.copy_(value.to(device=target.device, dtype=target.dtype))
    if strict:
        loaded = {id(expected[name]) for name in state} | {expected[name].data_ptr() for name in state}
        quantized = tuple(f"{name}." for name in checkpoint)
        missing = [
            name
            for name, value in expected.items()
            if name not in state
            and not name.startswith(quantized)
            and id(value) not in loaded
            and value.data_ptr() not in loaded
        ]
        if missing:
            raise CheckpointError(
                f"{folder}: the checkpoint does not provide the model's {', '.join(missing[:5])}"
                + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
                + "; pass strict=False to keep the model's own values"
            )
    return checkpoint
