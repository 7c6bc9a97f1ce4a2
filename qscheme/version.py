"""qscheme's version, in a module of its own so that layers below the top package can read it
(``qscheme.producers.self_described`` writes it into configs) without importing ``qscheme``."""

from __future__ import annotations

__version__ = "0.1.0"
