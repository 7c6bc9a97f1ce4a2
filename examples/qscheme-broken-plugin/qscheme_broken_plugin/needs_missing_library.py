"""Kernel code whose import fails: it needs a library that is not installed."""

from __future__ import annotations

import qscheme_example_missing_kernel_library  # noqa: F401  (does not exist, on purpose)


class Kernel:
    def prepare(self, weight: object, device: object) -> object:
        return weight

    def apply(self, state: object, x: object, bias: object) -> object:
        return x
