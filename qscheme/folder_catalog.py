"""The catalog without plugins: the built-in descriptors and the QSCHEME_SCHEME_PATH folders.

What is read, skipped and refused, and why, is described in ``qscheme.catalog``, which adds the
plugins' descriptors on top and re-exports the public names here. This part sits below
``qscheme.plugins``: a plugin scheme whose name the folders already define is refused as that
plugin's failure, so the plugin manager asks this module which names are taken.
"""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from qscheme.descriptor import Scheme, parse_scheme_file
from qscheme.descriptor.files import path_problem
from qscheme.errors import Location, Problem, SchemeError, SchemeNotFoundError

SCHEME_PATH_VARIABLE = "QSCHEME_SCHEME_PATH"
STRICT_VARIABLE = "QSCHEME_STRICT_SCHEMES"


class SchemePathWarning(UserWarning):
    """A descriptor file or scheme folder was skipped; the message names it and the problem."""


def strict_schemes(environ: Mapping[str, str] | None = None) -> bool:
    """Whether QSCHEME_STRICT_SCHEMES asks for skipped descriptors to be errors."""
    from qscheme.environment import env_flag

    return env_flag(STRICT_VARIABLE, environ)


def builtin_scheme_dir() -> Path:
    """The folder holding the built-in descriptors (schemes/ in a checkout, in the wheel too)."""
    return Path(str(resources.files("qscheme_schemes")))


def descriptor_files(folder: Path, problems: list[Problem] | None = None) -> list[Path]:
    """Every *.yaml / *.yml below a folder, sorted, each file once; hidden files and folders
    (``.name``) are skipped.

    Symlinked folders are followed. A folder reached twice (a symlink to a sibling folder) is
    read once; a symlink to a folder that contains the link (``back -> ..``) is reported as a
    loop. A file reached under two names (through a symlinked folder, a symlink or a hard link:
    the same file) is listed once, under the first name in sorted order. What cannot be read is
    a problem, never a silent skip: a folder that cannot be listed, and a ``*.yaml`` name that
    is a FIFO, socket or device, a dangling or looping symlink, or a file over the descriptor
    size cap (nothing is opened to find out). Problems are appended to ``problems`` when given,
    else raised as a SchemeError.
    """
    found: list[Problem] = []

    def report(error: OSError) -> None:
        where = error.filename or folder
        reason = error.strerror or str(error)
        found.append(
            Problem(
                Location(str(where)),
                f"cannot read this scheme folder: {reason}; make it readable (chmod +rx), or move it away",
            )
        )

    files: list[Path] = []
    seen = {_resolved(folder)}
    # the resolved folders each walked folder is reached through, itself included
    chains: dict[str, tuple[Path, ...]] = {os.fspath(folder): (_resolved(folder),)}
    for root, dirs, names in os.walk(folder, onerror=report, followlinks=True):
        chain = chains.pop(root, (_resolved(Path(root)),))
        kept = []
        for name in sorted(d for d in dirs if not d.startswith(".")):
            path = Path(root) / name
            target = _resolved(path)
            if path.is_symlink() and any(target == above or target in above.parents for above in chain):
                found.append(
                    Problem(
                        Location(str(path)),
                        f"is a symlink to {os.readlink(path)!r}, a folder that contains this link (a loop); it is "
                        "not read; remove the link",
                    )
                )
                continue
            if target in seen:  # the same folder reached again (a link to a sibling): read once
                continue
            seen.add(target)
            chains[os.path.join(root, name)] = (*chain, target)
            kept.append(name)
        dirs[:] = kept
        for name in sorted(names):
            path = Path(root) / name
            if name.startswith(".") or path.suffix not in (".yaml", ".yml"):
                continue
            problem = path_problem(path)
            if problem is None:
                files.append(path)
            else:
                found.append(Problem(Location(str(path)), f"{problem}; it is not read"))
    if found:
        if problems is None:
            raise SchemeError(found)
        problems.extend(found)
    return distinct_files(sorted(files))


def distinct_files(files: Iterable[Path], seen: set[object] | None = None) -> list[Path]:
    """``files`` less every file already listed, or in ``seen``, under another name (same
    device and inode); ``seen`` is updated."""
    seen = set() if seen is None else seen
    kept = []
    for file in files:
        identity = _file_identity(file)
        if identity not in seen:
            seen.add(identity)
            kept.append(file)
    return kept


def _file_identity(file: Path) -> object:
    try:
        info = file.stat()
    except OSError:
        return _resolved(file)
    return (info.st_dev, info.st_ino)


@dataclass(frozen=True)
class Catalog:
    """Schemes by name (names compare case-sensitively; lookups fall back to case-insensitive).

    ``skipped``: the descriptors and folders left out, each a located problem (``qscheme.catalog``'s
    module docstring).
    """

    schemes: dict[str, Scheme] = field(default_factory=dict)
    skipped: tuple[Problem, ...] = ()

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

    def suggestions(self, name: str) -> list[str]:
        """Known names ``name`` may have meant: those whose part after the producer is ``name``'s
        (``NVFP4A16`` -> ``compressed-tensors/NVFP4A16``, llm-compressor's preset name without a
        producer; ``FP8`` -> both producers' FP8), else the closest full names, else the names
        whose part after the producer is closest to ``name``'s."""
        short = name.rpartition("/")[2].lower()
        by_short: dict[str, list[str]] = {}
        for known in self.schemes:
            by_short.setdefault(known.rpartition("/")[2].lower(), []).append(known)
        if short in by_short:
            return sorted(by_short[short])
        if "/" not in name:  # no producer given: every producer's scheme of the closest name
            nearest = difflib.get_close_matches(short, list(by_short), n=1, cutoff=0.75)
            if nearest:
                return sorted(by_short[nearest[0]])
        close = difflib.get_close_matches(name, list(self.schemes), n=3, cutoff=0.5)
        if close:
            return close
        near = difflib.get_close_matches(short, list(by_short), n=2, cutoff=0.75)
        return sorted(known for key in near for known in by_short[key])[:3]

    def get(self, name: str) -> Scheme:
        """The scheme called ``name``; SchemeError listing close names otherwise."""
        scheme = self.find(name)
        if scheme is not None:
            return scheme
        close = self.suggestions(name)
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        if close and "/" not in name:
            hint += " Scheme names start with their producer (compressed-tensors/, modelopt/, ...)."
        raise SchemeNotFoundError(
            f"unknown scheme {name!r}.{hint} Run `qscheme schemes` to list the {len(self.schemes)} known schemes, "
            f"or pass a descriptor file path."
        )


def scheme_path_dirs(value: str | None = None) -> list[Path]:
    """The folders named by QSCHEME_SCHEME_PATH (os.pathsep-separated; empty entries ignored)."""
    raw = os.environ.get(SCHEME_PATH_VARIABLE, "") if value is None else value
    return [Path(part) for part in raw.split(os.pathsep) if part.strip()]


def build_catalog(sources: Iterable[tuple[str, Path]], base: Catalog | None = None, strict: bool = True) -> Catalog:
    """Parse every (source, file) pair into ``base``'s schemes; collect all problems; refuse
    a name already defined, also one that differs from it only by case.

    ``strict``: any problem raises SchemeError. Otherwise a file that is not built-in and has a
    problem is left out, its problems in the catalog's ``skipped``; a built-in one still raises.
    """
    schemes: dict[str, Scheme] = dict(base.schemes) if base is not None else {}
    by_folded: dict[str, Scheme] = {name.lower(): scheme for name, scheme in schemes.items()}
    fatal: list[Problem] = []
    skipped: list[Problem] = list(base.skipped) if base is not None else []
    for source, path in sources:
        found = fatal if strict or source == "builtin" else skipped
        try:
            scheme = parse_scheme_file(path, source=source)
        except SchemeError as exc:
            found.extend(exc.problems or [Problem(Location(str(path)), str(exc))])
            continue
        previous = by_folded.get(scheme.name.lower())
        if previous is not None:
            if previous.name == scheme.name:
                message = f"scheme name {scheme.name!r} is already defined by {previous.path} ({previous.source})"
            else:
                message = (
                    f"scheme name {scheme.name!r} differs only by case from {previous.name!r}, defined by "
                    f"{previous.path} ({previous.source}); names are looked up ignoring case, so one would hide the "
                    "other"
                )
            found.append(Problem(Location(str(path)), f"{message}; rename one of them"))
            continue
        schemes[scheme.name] = scheme
        by_folded[scheme.name.lower()] = scheme
    if fatal:
        raise SchemeError(fatal)
    return Catalog(schemes, tuple(skipped))


def catalog_sources(extra_dirs: Iterable[Path] = (), problems: list[Problem] | None = None) -> list[tuple[str, Path]]:
    """Built-ins, then QSCHEME_SCHEME_PATH folders, then extra folders (plugin files are added
    on top by ``load_catalog``).

    A folder named twice (or the built-in folder named again) is read once, and so is a file
    reached through two folders (one inside the other, or a symlinked one): under the first name
    found, silently. A folder that is missing or not a folder, and what ``descriptor_files``
    cannot read in one, are problems: appended to ``problems`` when given, else raised as a
    SchemeError. The built-in folder's problems are always raised.
    """
    builtin = builtin_scheme_dir()
    files_seen: set[object] = set()
    sources: list[tuple[str, Path]] = [("builtin", p) for p in distinct_files(descriptor_files(builtin), files_seen)]
    seen = {_resolved(builtin)}
    found: list[Problem] = []
    for folder in [*scheme_path_dirs(), *extra_dirs]:
        if not folder.is_dir():
            what = "does not exist" if not os.path.lexists(folder) else "is not a folder"
            found.append(
                Problem(
                    Location(str(folder)),
                    f"{SCHEME_PATH_VARIABLE} names this path, which {what}; fix the path or remove it from the "
                    "variable",
                )
            )
            continue
        if _resolved(folder) in seen:
            continue
        seen.add(_resolved(folder))
        files = distinct_files(descriptor_files(folder, found), files_seen)
        sources.extend((f"path:{folder}", p) for p in files)
    if found:
        if problems is None:
            raise SchemeError(found)
        problems.extend(found)
    return sources


def _resolved(folder: Path) -> Path:
    try:
        return folder.resolve()
    except (OSError, RuntimeError):
        return folder.absolute()


_CATALOG_CACHE: dict[tuple[object, ...], Catalog] = {}
_CATALOG_CACHE_LIMIT = 8  # the catalog without plugins, with them, and a few recent variants


def load_folder_catalog(extra_dirs: Sequence[Path], strict: bool) -> tuple[Catalog, tuple[object, ...]]:
    """The catalog of the built-ins, QSCHEME_SCHEME_PATH and ``extra_dirs`` (no plugins), and the
    key it is cached under: every source file with its size and modification time, and the
    folder problems.

    ``strict``: any problem is a SchemeError; otherwise a skipped file or folder is left out and
    listed in ``skipped``. Nothing is warned here (``warn_skipped``)."""
    folder_problems: list[Problem] = []  # also when strict: the error lists them with every other problem
    sources = catalog_sources(extra_dirs, folder_problems)
    key = (strict, *(str(p) for p in folder_problems), *_stamps(sources))
    return _cached(key, lambda: _build(sources, None, strict, folder_problems)), key


def extend_catalog(
    base: Catalog, base_key: tuple[object, ...], sources: list[tuple[str, Path]], strict: bool
) -> Catalog:
    """``base`` (built under ``base_key``) with the descriptors of ``sources`` added (the plugins'),
    cached while none of those files changes either."""
    return _cached(base_key + _stamps(sources), lambda: _build(sources, base, strict, []))


def warn_skipped(catalog: Catalog, stacklevel: int = 2) -> None:
    """One SchemePathWarning per skipped file or folder, at each call (Python's filters show a
    warning once per place); ``stacklevel`` as for ``warnings.warn``, counted from the caller."""
    for message in skipped_messages(catalog.skipped):
        warnings.warn(message, SchemePathWarning, stacklevel=stacklevel + 1)


def folder_scheme_names() -> dict[str, str]:
    """Where each scheme name the catalog defines without plugins is defined (``file (source)``).

    When that catalog is broken (a QSCHEME_SCHEME_PATH file that does not parse, under
    QSCHEME_STRICT_SCHEMES), the built-ins that parse are used: the catalog itself reports the
    broken file.
    """
    try:
        catalog, _ = load_folder_catalog([], strict_schemes())
    except SchemeError:
        pass
    else:
        warn_skipped(catalog)
        return scheme_origins(catalog)
    names: dict[str, str] = {}
    for file in descriptor_files(builtin_scheme_dir()):
        try:
            names[parse_scheme_file(file).name] = f"{file} (builtin)"
        except SchemeError:
            continue
    return names


def _build(sources: list[tuple[str, Path]], base: Catalog | None, strict: bool, problems: list[Problem]) -> Catalog:
    """``build_catalog``, with the folder problems added to what it skipped; ``strict``: one
    SchemeError listing the folder problems and every problem of the files (parse errors,
    duplicate names, names differing only by case)."""
    try:
        catalog = build_catalog(sources, base, strict)
    except SchemeError as exc:
        if strict and problems:
            raise SchemeError([*problems, *exc.problems]) from None  # build_catalog's errors list their problems
        raise
    if strict and problems:
        raise SchemeError(problems)
    return Catalog(catalog.schemes, (*problems, *catalog.skipped)) if problems else catalog


def skipped_messages(skipped: Iterable[Problem]) -> list[str]:
    """One message per skipped file or folder, naming it and every problem it has."""
    by_file: dict[str, list[Problem]] = {}
    for problem in skipped:
        by_file.setdefault(problem.location.file, []).append(problem)
    messages = []
    for file, problems in by_file.items():
        if len(problems) == 1:
            text = str(problems[0])
        else:
            text = f"{file}: {len(problems)} problems\n" + "\n".join(f"  {p}" for p in problems)
        messages.append(f"skipped {text}\n  (the other schemes load; {STRICT_VARIABLE}=1 makes this an error)")
    return messages


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
