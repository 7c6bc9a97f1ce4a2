"""A compiled extension with loops per instruction set, chosen at run time (``qscheme._cpu_gemv``,
``qscheme._tile_gemm``): importing it if it was built, applying its environment variable once per
value, and the narrowing a user or a test asks for, with a UsageError naming what this CPU runs.

Each extension module exports ``supported_isa()`` (the widest loops the CPU runs), ``isa()`` and
``set_isa(name)``; the names are ordered from the narrowest (a portable loop) to the widest.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import Any

from qscheme.environment import env_choice
from qscheme.errors import UsageError


@dataclass
class IsaExtension:
    """One optional extension: its module, its ISA names (narrowest first) and its variable."""

    module: str
    choices: tuple[str, ...]
    variable: str
    label: str  # how messages name its loops, e.g. "cpu_gemv"
    _applied: list[str | None] = field(default_factory=list, repr=False)
    _seen: list[Any] = field(default_factory=list, repr=False)  # [module, the variable's raw value] once applied

    def native(self) -> Any:
        """The extension, with the variable applied, or None where it was not built."""
        raw = os.environ.get(self.variable)
        if self._seen and self._seen[1] == raw:  # every kernel call asks: the variable as last applied
            return self._seen[0]
        try:
            module = importlib.import_module(self.module)
        except ImportError:
            return None
        chosen = env_choice(self.variable, self.choices)
        if self._applied != [chosen]:
            supported = module.supported_isa()
            if chosen is not None and self.choices.index(chosen) > self.choices.index(supported):
                raise UsageError(
                    f"environment variable {self.variable}={chosen}: this CPU runs at most the {supported} loops; "
                    f"allowed here: {', '.join(self.choices[: self.choices.index(supported) + 1])}, or unset it"
                )
            module.set_isa(chosen or supported)
            self._applied[:] = [chosen]
        self._seen[:] = [module, raw]
        return module

    def loops(self) -> str:
        """The module's ``isa()``, or the narrowest choice where it was not built."""
        module = self.native()
        return self.choices[0] if module is None else str(module.isa())

    def widest(self) -> str:
        """The module's ``supported_isa()``, or the narrowest choice where it was not built."""
        module = self.native()
        return self.choices[0] if module is None else str(module.supported_isa())

    def require(self) -> Any:
        """The extension, or a UsageError saying how to build it."""
        module = self.native()
        if module is None:
            raise UsageError(
                f"{self.module} is not built: reinstall qscheme with a C++17 compiler "
                "(pip install --no-build-isolation -e .)"
            )
        return module

    def set_isa(self, name: str) -> None:
        """Use the ``name`` loops from now on (at most what the CPU runs), as the variable does."""
        if name not in self.choices:
            raise UsageError(f"{self.label} ISA {name!r} is not one of {', '.join(self.choices)}")
        module = self.require()
        if self.choices.index(name) > self.choices.index(module.supported_isa()):
            raise UsageError(f"this CPU runs at most the {module.supported_isa()} {self.label} loops, not {name}")
        module.set_isa(name)
