"""Checks on the arguments of the public API, made before any tensor is read.

A value that is not a plain tensor fails deep inside torch (a sparse tensor has no strides, a
meta tensor no values, a nested tensor no sizes), far from the call that passed it. These
checks refuse it first, with QuantizeError naming the tensor, what it is, and what to pass. (A
scheme argument of the wrong type is refused by qscheme.catalog.require_scheme_argument, which
needs no torch.)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from qscheme.errors import QuantizeError

META_FIX = "materialise it first (load the real weights, e.g. module.to_empty(device='cpu') then load_state_dict)"


def require_tensor(
    value: object,
    source: str,
    what: str,
    fix: str = "pass the layer's checkpoint tensors keyed by name",
    meta_fix: str = META_FIX,
) -> Tensor:
    """``value`` if it is a dense, materialised torch.Tensor; else QuantizeError
    ``<source>: <what> ...`` saying what it is and, ``fix`` / ``meta_fix``, what to pass."""
    if not isinstance(value, Tensor):
        raise QuantizeError(f"{source}: {what} must be a torch.Tensor, not {type(value).__name__}; {fix}")
    if value.is_nested:
        raise QuantizeError(
            f"{source}: {what} is a nested tensor, which has no single [rows, columns] shape; pass the "
            "checkpoint's dense tensor"
        )
    if value.layout != torch.strided:
        raise QuantizeError(
            f"{source}: {what} is a sparse tensor ({str(value.layout).removeprefix('torch.')}); checkpoint "
            "tensors are dense: pass value.to_dense()"
        )
    if value.is_quantized:
        raise QuantizeError(
            f"{source}: {what} is a torch quantized tensor ({str(value.dtype).removeprefix('torch.')}); pass the "
            "tensor as the checkpoint stores it (plain integer or float dtype)"
        )
    if value.is_meta:
        raise QuantizeError(f"{source}: {what} is a meta tensor, which has a shape but no values; {meta_fix}")
    return value


def require_tensor_mapping(tensors: object, source: str, example: str) -> Mapping[str, Tensor]:
    """``tensors`` if it maps str checkpoint names to usable tensors (see ``require_tensor``);
    ``example``: a name the scheme declares, shown in the messages."""
    if not isinstance(tensors, Mapping):
        raise QuantizeError(
            f"{source}: tensors must be a mapping of checkpoint names to tensors (e.g. {{{example!r}: ...}}), "
            f"not {type(tensors).__name__}"
        )
    for name, value in tensors.items():
        if not isinstance(name, str):
            raise QuantizeError(
                f"{source}: tensor names must be the checkpoint names the scheme declares (str, e.g. {example!r}), "
                f"found {name!r} ({type(name).__name__}); key the tensors by name"
            )
        require_tensor(value, source, repr(name))
    return tensors
