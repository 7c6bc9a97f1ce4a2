"""The scheme catalog: built-in descriptors, folders on QSCHEME_SCHEME_PATH, and plugin ones.

Two descriptors with one name are an error naming both files; nothing is silently shadowed. A
plugin's descriptor whose name is already defined is refused as that plugin's failure instead
(``qscheme plugins`` shows it), so one plugin cannot break the catalog of every other scheme.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from qscheme.descriptor import Scheme, parse_scheme_file
from qscheme.errors import Location, Problem, SchemeError, SchemeNotFoundError

SCHEME_PATH_VARIABLE = "QSCHEME_SCHEME_PATH"


def builtin_scheme_dir() -> Path:
    """The folder holding the built-in descriptors (schemes/ in a checkout, in the wheel too)."""
    return Path(str(resources.files("qscheme_schemes")))


def descriptor_files(folder: Path, problems: list[Problem] | None = None) -> list[Path]:
    """Every *.yaml / *.yml below a folder, sorted; hidden files and folders (``.name``) are skipped.

    A folder that cannot be read is a problem, never a silent skip: it is appended to
    ``problems`` when given, else raised as a SchemeError.
    """
    unreadable: list[Problem] = []

    def report(error: OSError) -> None:
        where = error.filename or folder
        reason = error.strerror or str(error)
        unreadable.append(
            Problem(
                Location(str(where)),
                f"cannot read this scheme folder: {reason}; make it readable (chmod +rx), or move it away",
            )
        )

    files: list[Path] = []
    for root, dirs, names in os.walk(folder, onerror=report):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in names:
            path = Path(root) / name
            if not name.startswith(".") and path.suffix in (".yaml", ".yml") and path.is_file():
                files.append(path)
    if unreadable:
        if problems is None:
            raise SchemeError(unreadable)
        problems.extend(unreadable)
    return sorted(files)


@dataclass(frozen=True)
class Catalog:
    """Schemes by name (names compare case-sensitively; lookups fall back to case-insensitive)."""

    schemes: dict[str, Scheme] = field(default_factory=dict)

    def __iter__(self) -> Iterator[Scheme]:
        return iter(self.schemes[name] for name in sorted(self.schemes))

    def __len__(self) -> int:
        return len(self.schemes)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.find(name) is not None

    def find(self, name: str) -> Scheme | None:
        if name in self.schemes:
            return self.schemes[name]
        folded = [s for n, s in self.schemes.items() if n.lower() == name.lower()]
        return folded[0] if len(folded) == 1 else None

    def get(self, name: str) -> Scheme:
        """The scheme called ``name``; SchemeError listing close names otherwise."""
        scheme = self.find(name)
        if scheme is not None:
            return scheme
        close = difflib.get_close_matches(name, list(self.schemes), n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise SchemeNotFoundError(
            f"unknown scheme {name!r}.{hint} Run `qscheme schemes` to list the {len(self.schemes)} known schemes, "
            f"or pass a descriptor file path."
        )


def scheme_path_dirs(value: str | None = None) -> list[Path]:
    """The folders named by QSCHEME_SCHEME_PATH (os.pathsep-separated; empty entries ignored)."""
    raw = os.environ.get(SCHEME_PATH_VARIABLE, "") if value is None else value
    return [Path(part) for part in raw.split(os.pathsep) if part.strip()]


def build_catalog(sources: Iterable[tuple[str, Path]], base: Catalog | None = None) -> Catalog:
    """Parse every (source, file) pair into ``base``'s schemes; collect all problems; refuse
    duplicate names."""
    schemes: dict[str, Scheme] = dict(base.schemes) if base is not None else {}
    problems: list[Problem] = []
    for source, path in sources:
        try:
            scheme = parse_scheme_file(path, source=source)
        except SchemeError as exc:
            problems.extend(exc.problems or [Problem(Location(str(path)), str(exc))])
            continue
        previous = schemes.get(scheme.name)
        if previous is not None:
            problems.append(
                Problem(
                    Location(str(path)),
                    f"scheme name {scheme.name!r} is already defined by {previous.path} ({previous.source}); "
                    "rename one of them",
                )
            )
            continue
        schemes[scheme.name] = scheme
    if problems:
        raise SchemeError(problems)
    return Catalog(schemes)


def catalog_sources(extra_dirs: Iterable[Path] = ()) -> list[tuple[str, Path]]:
    """Built-ins, then QSCHEME_SCHEME_PATH folders, then extra folders (plugin files are added
    on top by ``load_catalog``).

    A folder named twice (or the built-in folder named again) is read once; an unreadable
    folder or subfolder is a SchemeError.
    """
    builtin = builtin_scheme_dir()
    sources: list[tuple[str, Path]] = [("builtin", p) for p in descriptor_files(builtin)]
    seen = {_resolved(builtin)}
    problems: list[Problem] = []
    for folder in [*scheme_path_dirs(), *extra_dirs]:
        if not folder.is_dir():
            raise SchemeError(
                f"{SCHEME_PATH_VARIABLE} names {str(folder)!r}, which is not a folder; "
                "fix the path or remove it from the variable"
            )
        if _resolved(folder) in seen:
            continue
        seen.add(_resolved(folder))
        sources.extend((f"path:{folder}", p) for p in descriptor_files(folder, problems))
    if problems:
        raise SchemeError(problems)
    return sources


def _resolved(folder: Path) -> Path:
    try:
        return folder.resolve()
    except (OSError, RuntimeError):
        return folder.absolute()


_CATALOG_CACHE: dict[tuple[object, ...], Catalog] = {}
_CATALOG_CACHE_LIMIT = 8  # the catalog without plugins, with them, and a few recent variants


def load_catalog(extra_dirs: Iterable[Path] = (), include_plugins: bool = True) -> Catalog:
    """The full catalog as the environment and installed plugins define it now.

    The built-ins and folders come first; a plugin scheme whose name they already define is
    refused as that plugin's failure (see ``qscheme.plugins``), never an error of the catalog.

    Parsing every descriptor costs ~0.1 s, so catalogs are reused while their sources are
    unchanged: the key is every source file with its size and modification time, so edited,
    added or removed descriptors (and a changed QSCHEME_SCHEME_PATH) are always seen.
    """
    sources = catalog_sources(extra_dirs)
    local_key = _stamps(sources)
    local = _cached(local_key, lambda: build_catalog(sources))
    if not include_plugins:
        return local
    plugin_files = _plugin_scheme_files(scheme_origins(local))
    if not plugin_files:
        return local
    return _cached(local_key + _stamps(plugin_files), lambda: build_catalog(plugin_files, local))


def scheme_origins(catalog: Catalog) -> dict[str, str]:
    """Where each scheme of a catalog is defined: ``file (source)`` by name."""
    return {name: f"{scheme.path} ({scheme.source})" for name, scheme in catalog.schemes.items()}


def _stamps(sources: list[tuple[str, Path]]) -> tuple[object, ...]:
    """A cache key: every source file with its modification time and size."""
    return tuple((source, str(path), *_stamp(path)) for source, path in sources)


def _cached(key: tuple[object, ...], build: Callable[[], Catalog]) -> Catalog:
    """The catalog built for ``key``, reused while no file changed; ``build`` raises on any
    problem, and nothing is cached then."""
    catalog = _CATALOG_CACHE.get(key)
    if catalog is None:
        catalog = build()
        if len(_CATALOG_CACHE) >= _CATALOG_CACHE_LIMIT:
            _CATALOG_CACHE.clear()
        _CATALOG_CACHE[key] = catalog
    return catalog


def _stamp(path: Path) -> tuple[int, int]:
    try:
        stat = path.stat()
    except OSError:
        return (-1, -1)  # parse_scheme_file reports the unreadable file
    return (stat.st_mtime_ns, stat.st_size)


def _plugin_scheme_files(taken: dict[str, str]) -> list[tuple[str, Path]]:
    """Descriptor files contributed by plugins (``qscheme_schemes`` hook), less the names taken."""
    try:
        from qscheme.plugins import plugin_scheme_files
    except ImportError:
        return []
    return plugin_scheme_files(taken)


def load_scheme(name_or_path: str | Path | Scheme) -> Scheme:
    """A Scheme from a catalog name, or from a descriptor file path."""
    if isinstance(name_or_path, Scheme):
        return name_or_path
    text = str(name_or_path)
    if text.endswith((".yaml", ".yml")) or (os.sep in text and Path(text).exists()):
        if Path(text).is_dir():
            raise SchemeError(
                f"{text!r} is a folder, not a descriptor file; pass a .yaml file, or put the folder on "
                "QSCHEME_SCHEME_PATH and use its schemes' names"
            )
        if not Path(text).is_file():
            raise SchemeNotFoundError(f"descriptor file {text!r} does not exist; check the path")
        return parse_scheme_file(text)
    return load_catalog().get(text)
