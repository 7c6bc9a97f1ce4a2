"""`qscheme validate FILE...`: check descriptors; exit 1 listing every problem in every file.

Besides each file on its own, the names are checked the way the catalog will check them: two
of the files with one name, or a file whose name a built-in or a QSCHEME_SCHEME_PATH scheme
already has, is a problem (unless the file is that catalog scheme's own file).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from qscheme.descriptor import Scheme, parse_scheme_file
from qscheme.descriptor.nodes import read_yaml
from qscheme.errors import Location, Problem, SchemeError


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "validate",
        help="validate descriptor files (exit 1 with every error listed)",
        description="Check descriptor files, and that their scheme names are unique among them and in the catalog "
        "(built-ins and QSCHEME_SCHEME_PATH folders).",
    )
    parser.add_argument("files", nargs="+", metavar="FILE", help="descriptor YAML files")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    results: list[tuple[str, Scheme | SchemeError]] = []
    for file in args.files:
        try:
            results.append((file, parse_scheme_file(file)))
        except SchemeError as exc:
            results.append((file, exc))
    name_problems = _name_problems([(file, r) for file, r in results if isinstance(r, Scheme)])
    failed = 0
    for file, result in results:
        if isinstance(result, Scheme) and name_problems.get(file):
            result = SchemeError(name_problems[file])
        if isinstance(result, SchemeError):
            failed += 1
            count = len(result.problems) or 1
            sys.stderr.write(f"{file}: {count} problem{'s' if count != 1 else ''}\n{result}\n")
            continue
        sys.stdout.write(f"{file}: ok ({result.name})\n")
    if failed:
        sys.stderr.write(f"{failed} of {len(args.files)} file(s) invalid\n")
        return 1
    return 0


def _name_problems(schemes: list[tuple[str, Scheme]]) -> dict[str, list[Problem]]:
    """Per file: its scheme name given by another of the files, or already in the catalog."""
    catalog = _catalog_origins()
    problems: dict[str, list[Problem]] = {}
    for file, scheme in schemes:
        here = _resolved(file)
        defined = catalog.get(scheme.name)
        catalog_file = _resolved(defined[0]) if defined is not None else None
        if catalog_file == here:
            continue  # the catalog's own file: a clash is the other file's problem
        others: dict[Path, str] = {}
        for other, other_scheme in schemes:
            where = _resolved(other)
            if other_scheme.name == scheme.name and where not in (here, catalog_file):
                others.setdefault(where, other)
        messages = [
            f"scheme name {scheme.name!r} is also used by {other}; scheme names must be unique: rename one of them"
            for other in others.values()
        ]
        if defined is not None:
            messages.append(
                f"scheme name {scheme.name!r} is already defined by {defined[0]} ({defined[1]}); the catalog "
                "refuses a second scheme of that name: rename this one"
            )
        if messages:
            location = _name_location(file)
            problems[file] = [Problem(location, message) for message in messages]
    return problems


def _catalog_origins() -> dict[str, tuple[str, str]]:
    """(file, source) of every built-in and QSCHEME_SCHEME_PATH scheme, by name; {} with a note if unreadable."""
    from qscheme.catalog import load_catalog

    try:
        catalog = load_catalog(include_plugins=False)
    except SchemeError as exc:
        first = str(exc).splitlines()[0] if str(exc) else "the catalog does not load"
        sys.stderr.write(f"note: names not checked against the catalog, which does not load: {first}\n")
        return {}
    return {name: (str(scheme.path), scheme.source) for name, scheme in catalog.schemes.items()}


def _resolved(file: str) -> Path:
    try:
        return Path(file).resolve()
    except (OSError, RuntimeError):
        return Path(file).absolute()


def _name_location(file: str) -> Location:
    """Where the file writes ``name:`` (the file parsed, so it reads again)."""
    try:
        root, _ = read_yaml(Path(file).read_text(encoding="utf-8"), file)
    except (OSError, UnicodeDecodeError):
        root = None
    node = root.value.get("name") if root is not None and root.is_mapping else None
    if node is None:
        return Location(file, None, None, "name")
    return Location(file, node.line, node.column, "name")
