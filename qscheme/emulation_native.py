"""The native pass of ``qscheme.emulation``'s FP8 and int8 activation rules.

``fake_quantize`` (``qscheme._cpu_gemv.prepare_input``, ``qscheme/csrc/act_quant*.cpp``) computes the
quantize-dequantize of the FP8 per-tensor, per-token and per-group-128 rules and the int8 per-token
rule in one pass over a CPU input, with the very float32 operations the torch path performs (the scale's division, each
element's division, e4m3's or int8's rounding, the product), so its output is bit for bit the torch
path's (tests/test_emulation_native.py compares the two). The torch path takes about 20 elementwise
operations and 8 ms at 256 x 4096 on one core; this pass reads the input once.

``apply_pass`` (``qscheme.emulation.prepare_input``'s native path) is the same pass with the AWQ
pre-scale before the rule (or alone) and a float32 or bfloat16 output, its rows shared out over
threads (``fake_quantize`` is it with a rule alone, a float32 output and one thread): the
input of ``dequant_gemm``'s bfloat16 tiles in one pass where torch took up to four (the upcast, the
pre-scale, the pass, the cast). At 256 x 4096 bf16 on a 2-core Zen 4: FP8 per token 0.44 ms in torch
(2 threads) against 0.40 ms on one thread and 0.21 ms on two; the pre-scale alone 0.17 ms against
0.15 and 0.08 ms.

``activation_codes`` (``qscheme._cpu_gemv.activation_codes``) is the same pass stopped before the
product: the codes' values and each token's scale (FP8 per tensor or per token, int8 per token),
which ``cpu_gemv`` multiplies as they are. At M = 1 it replaced about 90 us of torch operations per
layer call.

It runs where the ``qscheme._cpu_gemv`` extension is built, the input is a float32 or bfloat16 CPU
tensor that needs no gradient, and the caller is not being traced by torch.compile (which compiles
the torch path instead). ``QSCHEME_NATIVE_EMULATION=0`` turns it off (the torch path then runs).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from qscheme.emulation import ActivationRule

VARIABLE = "QSCHEME_NATIVE_EMULATION"

# rule name (qscheme.emulation.SUPPORTED_ACTIVATIONS) -> the pass's mode (act_quant.h)
MODES: Mapping[str, int] = MappingProxyType(
    {"FP8 per tensor": 0, "FP8 per token": 1, "FP8 per group": 2, "int8 per token": 3}
)

# the rules whose codes' values and scales ``activation_codes`` gives (one scale per token or per tensor)
CODE_MODES: Mapping[str, int] = MappingProxyType({"FP8 per tensor": 0, "FP8 per token": 1, "int8 per token": 3})

# the pre-scale alone, without a rule (apply_pass)
NO_RULE = 4

_INPUTS = (torch.float32, torch.bfloat16)


def enabled() -> bool:
    """Whether the native pass may run (the extension is built and the variable does not turn it off)."""
    if os.environ.get(VARIABLE, "1") == "0":
        return False
    from qscheme import cpu_gemv

    return cpu_gemv.available()


def _takes(x: Tensor) -> bool:
    """Whether the native pass takes ``x`` (see the module docstring)."""
    return not (
        x.device.type != "cpu"
        or x.dtype not in _INPUTS
        or (x.requires_grad and torch.is_grad_enabled())
        or torch.compiler.is_compiling()
        or not enabled()
    )


def fake_quantize(x: Tensor, rule: ActivationRule, input_scale: Tensor | None) -> Tensor | None:
    """``x`` quantized and dequantized by ``rule`` (float32, x's shape), or None where the native
    pass does not take it (see the module docstring); ``input_scale``: the static rule's float32
    multiplier, validated by the caller."""
    found = input_pass(rule, input_scale, None)
    return None if found is None else apply_pass(x, found, torch.float32, 1)


@dataclass(frozen=True)
class InputPass:
    """``prepare_input``'s pass as a native kernel applies it to each row of x (``tile_gemm.gemm``):
    the mode (``MODES``, or ``NO_RULE``), the group length, the static scale (0.0 for none) and the
    float32 pre-scale (contiguous, on the CPU) or None."""

    mode: int
    group: int
    scale: float
    pre_scale: Tensor | None

    @property
    def scale_bits(self) -> int:
        """The static scale's float32 bits, as the extension reads it."""
        return int(torch.tensor([self.scale], dtype=torch.float32).view(torch.int32).item()) & 0xFFFFFFFF


def input_pass(rule: ActivationRule | None, input_scale: Tensor | None, pre_scale: Tensor | None) -> InputPass | None:
    """``prepare_input``'s pass for ``rule`` (or none) and ``pre_scale`` (validated by the caller),
    or None where a native kernel cannot apply it (a rule outside ``MODES``, a pre-scale off the CPU)."""
    mode = NO_RULE if rule is None else MODES.get(rule.name)
    if mode is None or (pre_scale is not None and pre_scale.device.type != "cpu"):
        return None
    multipliers = None if pre_scale is None else pre_scale.detach().to(torch.float32).contiguous()
    scale = 0.0 if input_scale is None else float(input_scale.reshape(-1)[0])
    return InputPass(mode, 0 if rule is None else rule.group_size or 0, scale, multipliers)


def apply_pass(x: Tensor, found: InputPass, dtype: torch.dtype, threads: int) -> Tensor | None:
    """``found`` applied to ``x`` in one native pass, its rows shared over ``threads`` workers: a new
    tensor in ``dtype`` (float32, or bfloat16: the float32 values rounded to nearest even); None
    where the pass does not take it (another dtype, or see the module docstring)."""
    if dtype not in _INPUTS or not _takes(x):
        return None
    from qscheme import cpu_gemv

    values = x.detach().contiguous()
    out = torch.empty(values.shape, dtype=dtype)
    k = values.shape[-1]
    if values.numel() == 0:
        return out
    module = cpu_gemv.native()
    module.prepare_input(
        values.data_ptr(), values.dtype == torch.bfloat16, out.data_ptr(), dtype == torch.bfloat16,
        0 if found.pre_scale is None else found.pre_scale.data_ptr(), values.numel() // k, k, found.mode,
        found.group, found.scale, module.isa() == "avx512", max(1, threads),
    )  # fmt: skip
    return out


def activation_codes(x: Tensor, rule: ActivationRule, input_scale: Tensor | None) -> tuple[Tensor, Tensor] | None:
    """The values of ``x``'s codes under ``rule`` (float32, x's shape) and each token's scale
    (float32, ``[..., 1]``; the static scale repeated for every token), so that the dequantized
    input is their product; None where the native pass does not take it (a rule outside
    ``CODE_MODES``, or see the module docstring). ``input_scale``: the static rule's float32
    multiplier, validated by the caller."""
    found = input_pass(rule, input_scale, None) if rule.name in CODE_MODES else None
    if found is None or not _takes(x):
        return None
    from qscheme import cpu_gemv

    values = x.detach().contiguous()
    scales = torch.empty((*values.shape[:-1], 1), dtype=torch.float32)
    out = torch.empty(values.shape, dtype=torch.float32)
    k = values.shape[-1]
    if values.numel() == 0:
        return out, scales
    module = cpu_gemv.native()
    module.activation_codes(
        values.data_ptr(), values.dtype == torch.bfloat16, out.data_ptr(), scales.data_ptr(), values.numel() // k, k,
        found.mode, found.group, found.scale, module.isa() == "avx512",
    )  # fmt: skip
    return out, scales
