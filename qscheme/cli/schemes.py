"""`qscheme schemes [--json]`: list every scheme in the catalog, and what it skipped.

A descriptor or folder on QSCHEME_SCHEME_PATH that the catalog skips (see ``qscheme.catalog``)
is listed after the table (with --json: as a ``warning:`` line on stderr) and makes the command
exit 1, as a failed plugin makes `qscheme plugins` exit 1; the other schemes are listed all the
same.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any

from qscheme.catalog import SchemePathWarning, load_catalog, skipped_messages
from qscheme.cli.output import print_json, table
from qscheme.descriptor.summary import scheme_summary


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "schemes",
        help="list the known schemes (built-in, QSCHEME_SCHEME_PATH, plugins)",
        description="List the known schemes. Descriptors on QSCHEME_SCHEME_PATH that cannot be used are listed "
        "as skipped, and the command exits 1; QSCHEME_STRICT_SCHEMES=1 makes them an error.",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.json:  # the skipped files are SchemePathWarnings, shown on stderr by ``qscheme.cli.main``
        catalog = load_catalog()
        print_json([scheme_summary(scheme) for scheme in catalog])
        return 1 if catalog.skipped else 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SchemePathWarning)  # listed below
        catalog = load_catalog()
    records = [scheme_summary(scheme) for scheme in catalog]
    skipped = skipped_messages(catalog.skipped)
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
    out = [table(rows, ["scheme", "producer", "weights", "activations", "group", "source"])]
    if skipped:
        out.extend(["", "skipped:"])
        out.extend("  " + message.replace("\n", "\n  ") for message in skipped)
    out.append(f"{len(records)} schemes" + (f", {len(skipped)} skipped" if skipped else ""))
    sys.stdout.write("\n".join(out) + "\n")
    return 1 if skipped else 0
