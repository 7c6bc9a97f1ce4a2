"""Register qscheme's transformers quantizers whenever transformers loads its quantizer registry.

``import qscheme`` must stay cheap (importing transformers takes seconds) yet ``from_pretrained``
must route ``modelopt`` and ``qscheme`` checkpoints to qscheme whichever of the two packages is
imported first. So ``install()`` registers at once when transformers' registry module
(``transformers.quantizers.auto``) is already loaded, and otherwise puts a finder on
``sys.meta_path`` that matches that one module name. When Python loads the module, the finder
hands back the spec the other finders give, with its loader wrapped: the module executes as
usual, then ``qscheme.transformers`` is imported, which registers. The finder then removes
itself and the module gets its original loader back. Nothing here imports transformers.

A registration that fails (an incompatible transformers, say) does not break transformers'
import: it is a ``TransformersRegistrationWarning`` that names the error, and
``import qscheme.transformers`` raises it in full.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
import warnings
from collections.abc import Sequence
from types import ModuleType

REGISTRY_MODULE = "transformers.quantizers.auto"
INTEGRATION_MODULE = "qscheme.transformers"
_MARKER = "_qscheme_registers_quantizers"  # found on the finder, even across a reload of this module
_lock = threading.Lock()


class TransformersRegistrationWarning(UserWarning):
    """qscheme's quantizers could not be registered with transformers; the message says why."""


def register_now() -> bool:
    """Import ``qscheme.transformers`` (whose import registers), or call its ``register()`` when it
    is already imported; True on success. A failure is a warning naming the error, not an exception,
    because this runs inside transformers' own import."""
    try:
        module = sys.modules.get(INTEGRATION_MODULE)
        if module is None:
            importlib.import_module(INTEGRATION_MODULE)
        elif not getattr(getattr(module, "__spec__", None), "_initializing", False):
            module.register()
        # else: qscheme.transformers is being imported right now; its last line registers.
    except Exception as exc:
        warnings.warn(
            f"qscheme could not register its transformers quantizers ({type(exc).__name__}: {exc}); "
            "from_pretrained will not load 'modelopt' or 'qscheme' checkpoints through qscheme. "
            f"`import {INTEGRATION_MODULE}` shows the full error; check that the installed transformers "
            "is one qscheme supports (docs/transformers.md)",
            TransformersRegistrationWarning,
            stacklevel=2,
        )
        return False
    return True


class _RegisteringLoader(importlib.abc.Loader):
    """Runs the registry module with its own loader, then registers and restores that loader."""

    def __init__(self, finder: _RegistryFinder, loader: importlib.abc.Loader) -> None:
        self._finder = finder
        self._loader = loader

    def __getattr__(self, name: str) -> object:
        # get_source, get_filename, ... while the module executes (warnings, inspect) are its loader's
        return getattr(self._loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        module.__loader__ = self._loader
        self._finder.remove()
        register_now()


class _RegistryFinder(importlib.abc.MetaPathFinder):
    """Matches only ``transformers.quantizers.auto``; every other name costs one comparison."""

    def __init__(self) -> None:
        setattr(self, _MARKER, True)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != REGISTRY_MODULE:
            return None
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _RegisteringLoader(self, spec.loader)
            return spec
        return None

    def remove(self) -> None:
        with _lock:
            if self in sys.meta_path:
                sys.meta_path.remove(self)


def installed() -> bool:
    """Whether the finder is waiting on ``sys.meta_path`` for transformers' registry module."""
    return any(getattr(finder, _MARKER, False) for finder in sys.meta_path)


def install() -> None:
    """Register now if transformers' registry is loaded, else once it loads (idempotent, cheap)."""
    if REGISTRY_MODULE in sys.modules:
        register_now()
        return
    with _lock:
        if not installed():
            sys.meta_path.insert(0, _RegistryFinder())
