"""Defaults of ``qscheme run`` (kept free of torch so the command line's parser stays light)."""

from __future__ import annotations

DEFAULT_ROWS = 8
# max |y - y_ref| / max |y_ref| allowed per layer, by activation dtype (16-bit outputs are rounded)
DEFAULT_TOLERANCE: dict[str, float] = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-4}
