"""A plugin whose import fails, as when a plugin needs a library that is not installed."""

from __future__ import annotations

import qscheme_example_missing_dependency  # noqa: F401  (does not exist, on purpose)
