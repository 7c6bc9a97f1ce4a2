"""Listing names in messages: the first few, and how many more."""

from __future__ import annotations

from collections.abc import Sequence


def listing(names: Sequence[str], limit: int, sentence: bool = False) -> str:
    """``a, b, ... (3 more)``; with ``sentence``, ``a, b and 3 more`` (for prose)."""
    shown = ", ".join(names[:limit])
    if len(names) <= limit:
        return shown
    rest = len(names) - limit
    return f"{shown} and {rest} more" if sentence else f"{shown}, ... ({rest} more)"
