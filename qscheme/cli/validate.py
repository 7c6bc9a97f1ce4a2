"""`qscheme validate FILE...`: check descriptors; exit 1 listing every problem in every file.

Besides each file on its own, the names are checked the way the catalog will check them: two
of the files with one name (or names that differ only by case: lookups ignore case), or a file
whose name a built-in or a QSCHEME_SCHEME_PATH scheme already has, is a problem (unless the
file is that catalog scheme's own file). So are detect rules that claim a producer config
another of the files or a catalog scheme claims too (``qscheme.checkpoint.overlap``): loading a
checkpoint with that config would be refused as ambiguous. A descriptor whose layer size its
checkpoints cannot give back (``qscheme.descriptor.loadable``) is refused, since none would load.

What the catalog skips on QSCHEME_SCHEME_PATH with a warning (a broken descriptor, a FIFO or a
broken link named *.yaml, a clashing name, a missing folder) is an error here: it is listed
under ``QSCHEME_SCHEME_PATH`` and the exit code is 1.

Problems are listed grouped by kind (``problem_lines``): a file with 20,000 unknown keys, or an
alias repeated a thousand times, shows the first three of each kind and ``... and N more like
this``; the count in the file's heading is of all of them.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

from qscheme.cli.output import bounded_message
from qscheme.descriptor import Scheme, parse_scheme_file
from qscheme.descriptor.files import read_descriptor_text
from qscheme.descriptor.loadable import load_problems
from qscheme.descriptor.nodes import read_yaml
from qscheme.errors import Location, Problem, SchemeError
from qscheme.text import problem_lines

MAX_KINDS = 50  # kinds of problem listed per file; the rest are counted


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "validate",
        help="validate descriptor files (exit 1 with every error listed)",
        description="Check descriptor files: every problem located, scheme names unique among them and in the "
        "catalog (built-ins and QSCHEME_SCHEME_PATH folders, ignoring case), detect rules that overlap no other "
        "scheme's, and a layer size their checkpoints give back. What the catalog skips on QSCHEME_SCHEME_PATH "
        "(with a warning) is an error here. Exit 1 when anything is invalid.",
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
    catalog, skipped = _catalog_schemes()
    name_problems = _name_problems(valid, catalog)
    rule_problems = _rule_problems(valid, catalog)
    failed = 0
    for file, result in results:
        found = name_problems.get(file, []) + rule_problems.get(file, [])
        if isinstance(result, Scheme):
            found = _layer_size_problems(file, result) + found
        if isinstance(result, Scheme) and found:
            result = SchemeError(found)
        if isinstance(result, SchemeError):
            failed += 1
            count = len(result.problems) or 1
            sys.stderr.write(f"{file}: {count} problem{'s' if count != 1 else ''}\n{_listed(result)}\n")
            continue
        sys.stdout.write(f"{file}: ok ({result.name})\n")
    given = {_resolved(file) for file in args.files}
    on_path = [problem for problem in skipped if _resolved(problem.location.file) not in given]
    if on_path:
        sys.stderr.write(
            f"QSCHEME_SCHEME_PATH: {len(on_path)} problem{'s' if len(on_path) != 1 else ''} "
            "(the catalog skips these with a warning; validate refuses them)\n"
            + "\n".join(problem_lines(on_path, max_kinds=MAX_KINDS, bullet=""))
            + "\n"
        )
    if failed:
        sys.stderr.write(f"{failed} of {len(args.files)} file(s) invalid\n")
    return 1 if failed or on_path else 0


def _listed(error: SchemeError) -> str:
    """The problems of one file, a few of each kind (an error without a list: its bounded message)."""
    if not error.problems:
        return bounded_message(str(error))
    return "\n".join(problem_lines(error.problems, max_kinds=MAX_KINDS, bullet=""))


def _layer_size_problems(file: str, scheme: Scheme) -> list[Problem]:
    """The descriptor parses, but no checkpoint of it would load (its layer size is not recoverable)."""
    return [Problem(_location(file, *path.split(".")), message) for path, message in load_problems(scheme)]


def _name_problems(schemes: list[tuple[str, Scheme]], catalog: dict[str, Scheme]) -> dict[str, list[Problem]]:
    """Per file: its scheme name (or one differing only by case) given by another of the files, or
    already in the catalog."""
    problems: dict[str, list[Problem]] = {}
    for file, scheme in schemes:
        here = _resolved(file)
        folded = scheme.name.lower()
        defined = [other for name, other in catalog.items() if name.lower() == folded]
        catalog_files = {_resolved(str(other.path)) for other in defined if other.path is not None}
        if here in catalog_files:
            continue  # the catalog's own file: a clash is the other file's problem
        others: dict[Path, tuple[str, str]] = {}
        for other, other_scheme in schemes:
            where = _resolved(other)
            if other_scheme.name.lower() == folded and where != here and where not in catalog_files:
                others.setdefault(where, (other, other_scheme.name))
        messages = []
        for other, name in others.values():
            if name == scheme.name:
                messages.append(
                    f"scheme name {scheme.name!r} is also used by {other}; scheme names must be unique: "
                    "rename one of them"
                )
            else:
                messages.append(
                    f"scheme name {scheme.name!r} differs only by case from {name!r} in {other}; names are looked "
                    "up ignoring case, so one would hide the other: rename one of them"
                )
        for other_scheme in defined:
            if other_scheme.name == scheme.name:
                messages.append(
                    f"scheme name {scheme.name!r} is already defined by {other_scheme.path} ({other_scheme.source}); "
                    "the catalog refuses a second scheme of that name: rename this one"
                )
            else:
                messages.append(
                    f"scheme name {scheme.name!r} differs only by case from {other_scheme.name!r}, defined by "
                    f"{other_scheme.path} ({other_scheme.source}); names are looked up ignoring case, so the catalog "
                    "refuses it: rename this one"
                )
        if messages:
            location = _location(file, "name")
            problems[file] = [Problem(location, message) for message in messages]
    return problems


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
                f"a checkpoint whose config says that would be refused as ambiguous: {overlap.fix}"
            )
            problems.setdefault(file, []).append(Problem(_location(file, "detect", overlap.producer), message))
    return problems


def _catalog_schemes() -> tuple[dict[str, Scheme], tuple[Problem, ...]]:
    """Every built-in and QSCHEME_SCHEME_PATH scheme, by name, and what the catalog skipped
    there; ({}, ()) with a note if the built-ins themselves do not load."""
    from qscheme.catalog import SchemePathWarning, load_catalog

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SchemePathWarning)  # listed as errors by run()
            catalog = load_catalog(include_plugins=False, strict=False)
    except SchemeError as exc:
        first = str(exc).splitlines()[0] if str(exc) else "the catalog does not load"
        sys.stderr.write(f"note: names and rules not checked against the catalog, which does not load: {first}\n")
        return {}, ()
    return dict(catalog.schemes), catalog.skipped


def _resolved(file: str) -> Path:
    try:
        return Path(file).resolve()
    except (OSError, RuntimeError):
        return Path(file).absolute()


def _location(file: str, *keys: str) -> Location:
    """Where the file writes ``keys`` (the file parsed, so it reads again); the deepest found."""
    path = ".".join(keys)
    try:
        node, _ = read_yaml(read_descriptor_text(file), file)
    except SchemeError:
        return Location(file, None, None, path)
    line = column = None
    for key in keys:
        node = node.value.get(key) if node is not None and node.is_mapping else None
        if node is None:
            break
        line, column = node.line, node.column
    return Location(file, line, column, path)
