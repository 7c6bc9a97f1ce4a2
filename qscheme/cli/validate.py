"""`qscheme validate FILE...`: check descriptors; exit 1 listing every problem in every file.

Besides each file on its own, the names are checked the way the catalog will check them: two
of the files with one name, or a file whose name a built-in or a QSCHEME_SCHEME_PATH scheme
already has, is a problem (unless the file is that catalog scheme's own file). So are detect
rules that claim a producer config another of the files or a catalog scheme claims too
(``qscheme.checkpoint.overlap``): loading a checkpoint with that config would be refused as
ambiguous.
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
    valid = [(file, r) for file, r in results if isinstance(r, Scheme)]
    catalog = _catalog_schemes()
    name_problems = _name_problems(valid, catalog)
    rule_problems = _rule_problems(valid, catalog)
    failed = 0
    for file, result in results:
        found = name_problems.get(file, []) + rule_problems.get(file, [])
        if isinstance(result, Scheme) and found:
            result = SchemeError(found)
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


def _name_problems(schemes: list[tuple[str, Scheme]], catalog: dict[str, Scheme]) -> dict[str, list[Problem]]:
    """Per file: its scheme name given by another of the files, or already in the catalog."""
    problems: dict[str, list[Problem]] = {}
    for file, scheme in schemes:
        here = _resolved(file)
        defined = catalog.get(scheme.name)
        catalog_file = _resolved(str(defined.path)) if defined is not None else None
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
                f"scheme name {scheme.name!r} is already defined by {defined.path} ({defined.source}); the catalog "
                "refuses a second scheme of that name: rename this one"
            )
        if messages:
            location = _location(file, "name")
            problems[file] = [Problem(location, message) for message in messages]
    return problems


_RULE_FIXES = {
    "compressed-tensors": "make one rule more specific (list an argument the other lists, with another value) "
    "or remove one of them",
    "modelopt": "give the rules different quant_algo names or group_size values, or remove one of them",
}


def _rule_problems(schemes: list[tuple[str, Scheme]], catalog: dict[str, Scheme]) -> dict[str, list[Problem]]:
    """Per file: its detect rules that match a config another file's or a catalog scheme's match."""
    from qscheme.checkpoint.overlap import overlaps

    problems: dict[str, list[Problem]] = {}
    catalog_files = {_resolved(str(scheme.path)) for scheme in catalog.values()}
    for file, scheme in schemes:
        here = _resolved(file)
        others: dict[str, tuple[Scheme, str]] = {
            name: (other, f"{other.path} ({other.source})")
            for name, other in catalog.items()
            if _resolved(str(other.path)) != here
        }
        if here not in catalog_files:  # a catalog file's clash with a new file is the new file's problem
            for other_file, other in schemes:
                if _resolved(other_file) != here:
                    others.setdefault(other.name, (other, other_file))
        for overlap in overlaps(scheme, [other for other, _ in others.values()]):
            where = others[overlap.second][1]
            message = (
                f"matches what the rule of scheme {overlap.second!r} ({where}) matches, e.g. {overlap.witness}; "
                f"a checkpoint whose config says that would be refused as ambiguous: {_RULE_FIXES[overlap.producer]}"
            )
            problems.setdefault(file, []).append(Problem(_location(file, "detect", overlap.producer), message))
    return problems


def _catalog_schemes() -> dict[str, Scheme]:
    """Every built-in and QSCHEME_SCHEME_PATH scheme, by name; {} with a note if unreadable."""
    from qscheme.catalog import load_catalog

    try:
        catalog = load_catalog(include_plugins=False)
    except SchemeError as exc:
        first = str(exc).splitlines()[0] if str(exc) else "the catalog does not load"
        sys.stderr.write(f"note: names and rules not checked against the catalog, which does not load: {first}\n")
        return {}
    return dict(catalog.schemes)


def _resolved(file: str) -> Path:
    try:
        return Path(file).resolve()
    except (OSError, RuntimeError):
        return Path(file).absolute()


def _location(file: str, *keys: str) -> Location:
    """Where the file writes ``keys`` (the file parsed, so it reads again); the deepest found."""
    path = ".".join(keys)
    try:
        node, _ = read_yaml(Path(file).read_text(encoding="utf-8"), file)
    except (OSError, UnicodeDecodeError):
        return Location(file, None, None, path)
    line = column = None
    for key in keys:
        node = node.value.get(key) if node is not None and node.is_mapping else None
        if node is None:
            break
        line, column = node.line, node.column
    return Location(file, line, column, path)
