"""The typed error hierarchy: every error qscheme raises on bad input derives from QSchemeError.

Messages name the thing (file:line:column, key path, tensor, layer, kernel), the bad value,
what is allowed, and a fix, so that a user can act on them without reading a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass


class QSchemeError(Exception):
    """Base class of every error qscheme raises on bad input or impossible requests."""

    exit_code: int = 1


@dataclass(frozen=True)
class Location:
    """Where a problem is: a file, and where known a line, a column and a key path."""

    file: str
    line: int | None = None
    column: int | None = None
    key_path: str = ""

    def __str__(self) -> str:
        where = self.file
        if self.line is not None:
            where += f":{self.line}"
            if self.column is not None:
                where += f":{self.column}"
        return where


@dataclass(frozen=True)
class Problem:
    """One located problem in a descriptor: where, and the message about the value found."""

    location: Location
    message: str

    def __str__(self) -> str:
        prefix = f"{self.location}: "
        if self.location.key_path:
            prefix += f"{self.location.key_path}: "
        return prefix + self.message


class SchemeError(QSchemeError):
    """A scheme descriptor is invalid, or a scheme name or file cannot be found."""

    def __init__(self, problems: list[Problem] | str) -> None:
        if isinstance(problems, str):
            self.problems: list[Problem] = []
            text = problems
        else:
            self.problems = list(problems)
            text = "\n".join(str(p) for p in self.problems)
        super().__init__(text)


class FormatError(QSchemeError, ValueError):
    """An unknown element format or packing, or a tensor that does not fit one."""


class QuantizeError(QSchemeError, ValueError):
    """quantize_weight / dequantize_weight were given tensors that do not fit the scheme."""


class CheckpointError(QSchemeError):
    """A checkpoint folder, config or tensor is missing, malformed or inconsistent."""


class NoKernelError(QSchemeError):
    """No kernel can run a layer; the message holds the full resolution trace."""


class PluginError(QSchemeError):
    """A plugin failed to load or returned something malformed (fatal only in strict mode)."""


class UsageError(QSchemeError, ValueError):
    """A command-line or API argument is not one of the allowed values."""

    exit_code = 2
