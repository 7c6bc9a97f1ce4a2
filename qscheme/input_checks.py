"""Non-finite inputs to layers that quantize their activations.

Quantizing an activation maps a group (a token, a block of 16 or 32) through a scale taken
from its largest magnitude. An ``inf`` or ``NaN`` in the group breaks that scale, and kernels
then disagree: one clamps ``inf`` to the largest code and returns finite, wrong outputs,
another returns ``NaN``, a third ``inf`` (NVFP4 W4A4 and FP8 dynamic, measured on the
reference and Triton kernels). An unquantized ``nn.Linear`` would propagate the non-finite
value instead. So a ``QuantLinear`` whose scheme quantizes activations:

- on a CPU, refuses a non-finite input with NonFiniteInputError naming the layer, the count
  and the first position (checking costs one pass over the input, no device synchronisation);
- on other devices, where raising would need a synchronisation per layer, makes the output
  rows of non-finite inputs NaN, as IEEE arithmetic would (two reductions over the input), so
  that every kernel gives the same answer and no row comes back finite and wrong.

Weight-only schemes multiply the input as given and propagate ``inf``/``NaN`` themselves.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qscheme.errors import QSchemeError


class NonFiniteInputError(QSchemeError, ValueError):
    """A layer that quantizes its activations was given an ``inf`` or ``NaN`` input (on a CPU)."""

    def __init__(self, message: str, *, layer: str, count: int) -> None:
        super().__init__(message)
        self.layer = layer
        self.count = count


_NATIVE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _all_finite_natively(x: Tensor) -> bool:
    """True where the ``qscheme._cpu_gemv`` extension read every element of ``x`` and found no
    ``inf`` or ``NaN`` in one pass (about 20x faster than ``torch.isfinite(x).all()`` on a token);
    False where it found one or does not take x (another dtype, not contiguous, traced, not built)."""
    dtype = _NATIVE_DTYPES.get(x.dtype)
    if dtype is None or x.device.type != "cpu" or not x.is_contiguous() or torch.compiler.is_compiling():
        return False
    from qscheme.cpu_gemv import native  # the module path: importing the package would reach the loader

    module = native()
    if module is None:
        return False
    return bool(module.all_finite(x.data_ptr(), dtype, x.numel(), module.isa() == "avx512"))


def refuse_non_finite(x: Tensor, layer: str, scheme: str) -> None:
    """NonFiniteInputError when ``x`` holds ``inf`` or ``NaN`` (call for CPU inputs only: it reads a value)."""
    if _all_finite_natively(x):
        return
    finite = torch.isfinite(x)
    if bool(finite.all()):
        return
    bad = (~finite).nonzero()
    first = bad[0].tolist()
    value = float(x[tuple(first)])
    raise NonFiniteInputError(
        f"{layer}: the input holds {bad.shape[0]} non-finite value(s) (first: {value} at index {first} of "
        f"{list(x.shape)}); scheme {scheme} quantizes activations, and a scale taken from inf or NaN gives "
        "results that differ between kernels (some finite and wrong). An earlier layer overflowed or the input "
        "is corrupt: check the model's dtype (float16 overflows above 65504; use bfloat16) and the inputs",
        layer=layer,
        count=int(bad.shape[0]),
    )


def poison_non_finite_rows(y: Tensor, x: Tensor) -> Tensor:
    """``y`` with the rows whose input row holds ``inf`` or ``NaN`` set to NaN (no synchronisation)."""
    # max - min is inf or NaN exactly where the row holds inf or NaN (no copy of x is made)
    marker = x.amax(dim=-1, keepdim=True) - x.amin(dim=-1, keepdim=True)
    return y + (marker * 0).to(y.dtype)
