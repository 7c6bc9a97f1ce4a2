"""Checks on the arguments of the public API, made before any tensor is read.

A value that is not a plain tensor fails deep inside torch (a sparse tensor has no strides, a
meta tensor no values, a nested tensor no sizes), far from the call that passed it. These
checks refuse it first, with QuantizeError naming the tensor, what it is, and what to pass. (A
scheme argument of the wrong type is refused by qscheme.catalog.require_scheme_argument, which
needs no torch.) Flags and names (``strict``, ``progress``, ``layer_name``) are checked for
their type too: ``strict="no"`` would otherwise count as true.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from qscheme.errors import QuantizeError, UsageError

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


def require_flag(value: object, name: str, caller: str) -> bool:
    """``value`` if it is True or False; UsageError otherwise (``strict="no"`` is not False)."""
    if isinstance(value, bool):
        return value
    raise UsageError(
        f"{caller}: {name} must be True or False, not {value!r} ({type(value).__name__}); a string such as "
        f"'no' would count as true: pass {name}=False"
    )


def require_optional_flag(value: object, name: str, caller: str) -> bool | None:
    """``value`` if it is True, False or None (automatic); UsageError otherwise."""
    if value is None or isinstance(value, bool):
        return value
    raise UsageError(
        f"{caller}: {name} must be True, False or None (automatic), not {value!r} ({type(value).__name__}); "
        f"pass {name}=True or {name}=False"
    )


def require_optional_name(value: object, name: str, caller: str) -> str | None:
    """``value`` if it is a str or None; UsageError otherwise."""
    if value is None or isinstance(value, str):
        return value
    raise UsageError(
        f"{caller}: {name} must be a str (the module's name, e.g. 'model.layers.0.mlp.up_proj') or None, "
        f"not {value!r} ({type(value).__name__})"
    )
