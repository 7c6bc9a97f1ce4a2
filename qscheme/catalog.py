"""The scheme catalog: built-in descriptors, folders on QSCHEME_SCHEME_PATH, and plugin ones.

Nothing is silently skipped or shadowed. A descriptor on QSCHEME_SCHEME_PATH that does not
parse, a name there that another descriptor already has (also when they differ only by case:
lookups ignore case), a FIFO, device, dangling or looping symlink named ``*.yaml``, and a folder
that is missing or cannot be read are each skipped with a ``SchemePathWarning`` naming the file
and the problem, kept in ``Catalog.skipped``, and shown by ``qscheme schemes``; every other
scheme still loads, as with a broken plugin descriptor. ``QSCHEME_STRICT_SCHEMES=1`` (and
``qscheme validate``) make them errors. A broken built-in descriptor is always an error.

A plugin's descriptor whose name is already defined is refused as that plugin's failure instead
(``qscheme plugins`` shows it), so one plugin cannot break the catalog of every other scheme.

The built-ins and folders are read in ``qscheme.folder_catalog`` (its public names are
re-exported here), below ``qscheme.plugins``; this module adds the plugins' descriptors on top
and looks schemes up.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from qscheme.descriptor import Scheme, parse_scheme_file
from qscheme.descriptor.files import path_problem
from qscheme.errors import Location, Problem, SchemeError, SchemeNotFoundError, UsageError
from qscheme.folder_catalog import (
    SCHEME_PATH_VARIABLE,
    STRICT_VARIABLE,
    Catalog,
    SchemePathWarning,
    build_catalog,
    builtin_scheme_dir,
    catalog_sources,
    descriptor_files,
    distinct_files,
    extend_catalog,
    load_folder_catalog,
    scheme_origins,
    scheme_path_dirs,
    skipped_messages,
    strict_schemes,
    warn_skipped,
)

__all__ = [
    "SCHEME_PATH_VARIABLE",
    "STRICT_VARIABLE",
    "Catalog",
    "SchemePathWarning",
    "build_catalog",
    "builtin_scheme_dir",
    "catalog_sources",
    "descriptor_files",
    "distinct_files",
    "load_catalog",
    "load_scheme",
    "require_scheme_argument",
    "scheme_origins",
    "scheme_path_dirs",
    "skipped_messages",
    "strict_schemes",
]


def load_catalog(extra_dirs: Iterable[Path] = (), include_plugins: bool = True, strict: bool | None = None) -> Catalog:
    """The full catalog as the environment and installed plugins define it now.

    The built-ins and folders come first; a plugin scheme whose name they already define is
    refused as that plugin's failure (see ``qscheme.plugins``), never an error of the catalog.
    What cannot be used on QSCHEME_SCHEME_PATH is skipped with a SchemePathWarning and listed in
    ``skipped``, unless ``strict`` (default: QSCHEME_STRICT_SCHEMES) makes it a SchemeError.

    Parsing every descriptor costs ~0.1 s, so catalogs are reused while their sources are
    unchanged: the key is every source file with its size and modification time, so edited,
    added or removed descriptors (and a changed QSCHEME_SCHEME_PATH) are always seen.
    """
    if isinstance(extra_dirs, str | bytes | os.PathLike) or not isinstance(extra_dirs, Iterable):
        raise UsageError(
            f"load_catalog: extra_dirs must be a list of folders, not {type(extra_dirs).__name__} "
            f"{extra_dirs!r:.80}; e.g. load_catalog([Path('my-schemes')])"
        )
    strict = strict_schemes() if strict is None else strict
    local, key = load_folder_catalog([Path(folder) for folder in extra_dirs], strict)
    catalog = local
    if include_plugins:
        plugin_files = _plugin_scheme_files(scheme_origins(local))
        if plugin_files:
            catalog = extend_catalog(local, key, plugin_files, strict)
    warn_skipped(catalog)
    return catalog


def _plugin_scheme_files(taken: dict[str, str]) -> list[tuple[str, Path]]:
    """Descriptor files contributed by plugins (``qscheme_schemes`` hook), less the names taken.

    Imported on first use, not at the top: ``import qscheme`` loads the catalog, and pluggy and
    the plugins need not load with it (``qscheme.plugins`` itself imports only the folder part)."""
    try:
        from qscheme.plugins import plugin_scheme_files
    except ImportError:
        return []
    return plugin_scheme_files(taken)


def require_scheme_argument(scheme: object, caller: str) -> None:
    """UsageError unless ``scheme`` is a Scheme, a catalog name or a descriptor file path
    (anything else would be looked up by its ``str()`` as an unknown name)."""
    if not isinstance(scheme, Scheme | str | os.PathLike):
        shown = repr(scheme)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise UsageError(
            f"{caller}: scheme must be a Scheme, a catalog name (str) or a descriptor file path, not "
            f"{type(scheme).__name__} ({shown}); e.g. 'compressed-tensors/NVFP4' (`qscheme schemes` lists them)"
        )


def load_scheme(name_or_path: str | Path | Scheme) -> Scheme:
    """A Scheme from a catalog name, or from a descriptor file path."""
    if isinstance(name_or_path, Scheme):
        return name_or_path
    require_scheme_argument(name_or_path, "load_scheme")
    text = str(name_or_path)
    if text.endswith((".yaml", ".yml")) or (os.sep in text and os.path.lexists(text)):
        if Path(text).is_dir():
            raise SchemeError(
                f"{text!r} is a folder, not a descriptor file; pass a .yaml file, or put the folder on "
                "QSCHEME_SCHEME_PATH and use its schemes' names"
            )
        if not os.path.lexists(text):
            raise SchemeNotFoundError(f"descriptor file {text!r} does not exist; check the path")
        problem = path_problem(Path(text))  # a FIFO, device, broken link or huge file: an input error
        if problem is not None:
            raise SchemeNotFoundError([Problem(Location(text), problem)])
        return parse_scheme_file(text)
    return load_catalog().get(text)
