"""One kernel launch as data: the kernel, its grid, arguments and compile-time options.

The host code builds ``Launch`` values and runs them; the compile-only check builds the same
values from CPU tensors and compiles them for GPUs this machine does not have, so what is
compiled there is exactly what would be launched.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Launch:
    """``kernel[grid](**args, **constexprs, num_warps=..., num_stages=...)``."""

    kernel: Any  # a triton JITFunction (or InterpretedFunction)
    grid: tuple[int, ...]
    args: Mapping[str, Any]  # runtime arguments by name: tensors and integers
    constexprs: Mapping[str, Any]
    num_warps: int = 4
    num_stages: int = 3
    label: str = field(default="", compare=False)

    def run(self) -> None:
        self.kernel[self.grid](**self.args, **self.constexprs, num_warps=self.num_warps, num_stages=self.num_stages)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids and buffer sizes. ``triton.cdiv`` does the same, but as a
    constexpr function it costs microseconds per host call."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1); ``triton.next_power_of_2`` on the host."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def has_fp8_conversion(capability: tuple[int, int] | None) -> bool:
    """Whether a GPU converts e4m3 to floats in hardware: CUDA compute capability 8.9 or newer
    (None: ROCm or unknown, decoded with integer operations)."""
    return capability is not None and capability >= (8, 9)
