"""`qscheme schemes [--json]`: list every scheme in the catalog."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from qscheme.catalog import load_catalog
from qscheme.cli.output import print_json, table
from qscheme.descriptor.summary import scheme_summary


def register(sub: Any) -> None:
    parser = sub.add_parser("schemes", help="list the known schemes (built-in, QSCHEME_SCHEME_PATH, plugins)")
    parser.add_argument("--json", action="store_true", help="print a JSON list")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    catalog = load_catalog()
    records = [scheme_summary(scheme) for scheme in catalog]
    if args.json:
        print_json(records)
        return 0
    rows = [
        [
            r["name"],
            r["producer"] or "-",
            r["weight_format"],
            r["activation_format"],
            str(r["group_size"] or "-"),
            r["source"],
        ]
        for r in records
    ]
    sys.stdout.write(table(rows, ["scheme", "producer", "weights", "activations", "group", "source"]) + "\n")
    sys.stdout.write(f"{len(records)} schemes\n")
    return 0
