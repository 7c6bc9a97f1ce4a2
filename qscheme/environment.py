"""qscheme's environment variables, read strictly: a value outside the allowed set is an error.

A switch (``QSCHEME_STRICT_PLUGINS``, ``QSCHEME_DISABLE_PLUGIN_AUTOLOAD``, ...) is on for
``1``, ``true``, ``yes`` or ``on`` and off for ``0``, ``false``, ``no``, ``off``, the empty
string or unset (case and surrounding spaces ignored). Anything else (``2``, ``enable``,
``ture``) is a UsageError naming the variable, the value and what is allowed, rather than
silently meaning "off". A list of plugin names (``QSCHEME_PLUGINS``) holds comma-separated
entry-point or distribution names. No torch here: the plugin manager reads these first.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from qscheme.errors import UsageError

TRUE_VALUES: tuple[str, ...] = ("1", "true", "yes", "on")
FALSE_VALUES: tuple[str, ...] = ("0", "false", "no", "off", "")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")
MAX_SHOWN = 80


def _shown(value: str) -> str:
    return repr(value if len(value) <= MAX_SHOWN else value[:MAX_SHOWN] + "...")


def env_flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether switch ``name`` is on; UsageError for a value that is neither on nor off."""
    value = (os.environ if environ is None else environ).get(name)
    if value is None:
        return False
    word = value.strip().lower()
    if word in TRUE_VALUES:
        return True
    if word in FALSE_VALUES:
        return False
    raise UsageError(
        f"environment variable {name}={_shown(value)} is not understood; allowed: "
        f"{', '.join(TRUE_VALUES)} (on) or {', '.join(v for v in FALSE_VALUES if v)}, empty or unset (off); "
        f"e.g. export {name}=1, or unset it"
    )


def env_choice(name: str, allowed: tuple[str, ...], environ: Mapping[str, str] | None = None) -> str | None:
    """The value of ``name``, one of ``allowed`` (None when unset or empty); UsageError otherwise."""
    value = (os.environ if environ is None else environ).get(name)
    if value is None or not value.strip():
        return None
    word = value.strip().lower()
    if word in allowed:
        return word
    raise UsageError(
        f"environment variable {name}={_shown(value)} is not understood; allowed: {', '.join(allowed)}, empty or "
        f"unset; e.g. export {name}={allowed[0]}, or unset it"
    )


def env_names(name: str, environ: Mapping[str, str] | None = None) -> frozenset[str] | None:
    """The comma-separated names in ``name`` (None when unset; an empty value names none);
    UsageError for an entry that is not a plugin or distribution name."""
    value = (os.environ if environ is None else environ).get(name)
    if value is None:
        return None
    names = [part.strip() for part in value.split(",")]
    bad = [part for part in names if part and not _NAME.fullmatch(part)]
    if bad:
        raise UsageError(
            f"environment variable {name}={_shown(value)}: {_shown(bad[0])} is not a plugin name; allowed: "
            "comma-separated entry-point or distribution names (letters, digits, '_', '.', '-'), e.g. "
            f"export {name}=my-plugin,other-dist, or an empty value to load none"
        )
    return frozenset(part for part in names if part)
