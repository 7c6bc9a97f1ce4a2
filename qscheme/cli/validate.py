"""`qscheme validate FILE...`: check descriptors; exit 1 listing every problem in every file."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from qscheme.descriptor import parse_scheme_file
from qscheme.errors import SchemeError


def register(sub: Any) -> None:
    parser = sub.add_parser("validate", help="validate descriptor files (exit 1 with every error listed)")
    parser.add_argument("files", nargs="+", metavar="FILE", help="descriptor YAML files")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    failed = 0
    for file in args.files:
        try:
            scheme = parse_scheme_file(file)
        except SchemeError as exc:
            failed += 1
            count = len(exc.problems) or 1
            sys.stderr.write(f"{file}: {count} problem{'s' if count != 1 else ''}\n{exc}\n")
            continue
        sys.stdout.write(f"{file}: ok ({scheme.name})\n")
    if failed:
        sys.stderr.write(f"{failed} of {len(args.files)} file(s) invalid\n")
        return 1
    return 0
