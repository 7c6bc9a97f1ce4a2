"""The typed error hierarchy: every error qscheme raises on bad input derives from QSchemeError.

Messages name the thing (file:line:column, key path, tensor, layer, kernel), the bad value,
what is allowed, and a fix, so that a user can act on them without reading a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass


class QSchemeError(Exception):
    """Base class of every error qscheme raises on bad input or impossible requests.

    ``exit_code`` is what the ``qscheme`` command exits with: 1 when a check ran and failed,
    2 when the input or a usage is wrong (see InputError and UsageError).
    """

    exit_code: int = 1


class InputError(QSchemeError):
    """The input named on the command line cannot be found or used (exit code 2).

    Raised combined with the error type of the input (SchemeNotFoundError, CheckpointNotFoundError),
    so that ``except SchemeError`` / ``except CheckpointError`` still catch it.
    """

    exit_code = 2


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


class SchemeNotFoundError(SchemeError, InputError):
    """No scheme of that name in the catalog, or no descriptor file at that path (exit code 2)."""


class FormatError(QSchemeError, ValueError):
    """An unknown element format or packing, or a tensor that does not fit one."""


class QuantizeError(QSchemeError, ValueError):
    """quantize_weight / dequantize_weight were given tensors that do not fit the scheme."""


class CheckpointError(QSchemeError):
    """A checkpoint folder, config or tensor is missing, malformed or inconsistent."""


class CheckpointNotFoundError(CheckpointError, InputError):
    """The checkpoint path does not exist or is not a folder (exit code 2)."""


class OutputError(QSchemeError):
    """The command's output could not be written (a full disk, a closed stream): exit code 1."""


class DestinationError(OutputError):
    """A checkpoint's output folder is refused or cannot be written (exit code 1): it exists, it
    is or holds the source, or the disk refused it. Unlike a failing stdout, the command can still
    report it, on stderr and as ``--json``'s error object."""


class NoKernelError(QSchemeError):
    """No kernel can run a layer; the message holds the full resolution trace."""


class PluginError(QSchemeError):
    """A plugin failed to load or returned something malformed (fatal only in strict mode)."""


class UsageError(QSchemeError, ValueError):
    """A command-line or API argument is not one of the allowed values."""

    exit_code = 2
