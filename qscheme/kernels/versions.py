"""Version ranges of kernel libraries, as data: ``">=0.33,<0.34"`` against an installed version.

No third-party parser: a specifier is comma-separated clauses ``OP VERSION`` with OP one of
``>=``, ``>``, ``<=``, ``<``, ``==``, ``!=``; versions compare by their leading numeric release
segments (``0.33.0rc1.dev5+cu128`` compares as 0.33.0), zero-padded, so ``0.33 == 0.33.0``.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable

_CLAUSE = re.compile(r"^\s*(>=|<=|==|!=|>|<)\s*(\d+(?:\.\d+)*)\s*$")
_RELEASE = re.compile(r"^\s*v?(\d+(?:\.\d+)*)")
_OPERATORS: dict[str, Callable[[tuple[int, ...], tuple[int, ...]], bool]] = {
    ">=": operator.ge,
    ">": operator.gt,
    "<=": operator.le,
    "<": operator.lt,
    "==": operator.eq,
    "!=": operator.ne,
}


def release(version: str) -> tuple[int, ...] | None:
    """The numeric release of a version string (``2.13.0+cpu`` -> (2, 13, 0)); None if it has none."""
    match = _RELEASE.match(version)
    return None if match is None else tuple(int(part) for part in match.group(1).split("."))


def _padded(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    width = max(len(a), len(b))
    return a + (0,) * (width - len(a)), b + (0,) * (width - len(b))


def parse_specifier(specifier: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """``">=0.33,<0.34"`` -> ((">=", (0, 33)), ("<", (0, 34))); ValueError naming the bad clause."""
    clauses = []
    for text in specifier.split(","):
        match = _CLAUSE.match(text)
        if match is None:
            raise ValueError(
                f"version clause {text.strip()!r} of {specifier!r} is not OP VERSION with OP one of "
                f"{', '.join(_OPERATORS)} (e.g. '>=0.33,<0.34')"
            )
        clauses.append((match.group(1), tuple(int(p) for p in match.group(2).split("."))))
    return tuple(clauses)


def satisfies(version: str, specifier: str) -> bool:
    """Whether the installed ``version`` is inside ``specifier`` (False when it has no release)."""
    have = release(version)
    if have is None:
        return False
    for op, wanted in parse_specifier(specifier):
        left, right = _padded(have, wanted)
        if not _OPERATORS[op](left, right):
            return False
    return True
