"""Kernel code that imports fine but is not usable: no ``MissingKernel`` here, and
``PrepareOnlyKernel`` lacks ``apply``."""

from __future__ import annotations


class PrepareOnlyKernel:
    def prepare(self, weight: object, device: object) -> object:
        return weight
