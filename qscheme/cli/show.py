"""`qscheme show NAME|FILE [--json]`: everything a scheme declares."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from qscheme.catalog import load_scheme
from qscheme.cli.output import print_json
from qscheme.descriptor.summary import render_scheme, scheme_dict


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "show",
        help="show one scheme: formats, tensors, conventions, detection",
        description="Show one scheme. Exit 2 when the name is unknown, or the file does not exist or is not a "
        "regular descriptor file of at most 1 MiB (a FIFO, a device, a broken link); exit 1 when it is invalid.",
    )
    parser.add_argument(
        "target", metavar="NAME|FILE", help="a scheme name (see `qscheme schemes`) or a descriptor file"
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    scheme = load_scheme(args.target)  # a skipped descriptor is a warning, shown by qscheme.cli.main
    if args.json:
        print_json(scheme_dict(scheme))
    else:
        sys.stdout.write(render_scheme(scheme) + "\n")
    return 0
