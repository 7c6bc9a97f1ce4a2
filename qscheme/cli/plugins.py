"""`qscheme plugins [--json]`: every plugin, what it adds, and why it failed if it did.

Exit 1 when any plugin failed (the list is printed all the same), 0 otherwise. Names and
versions come from third-party metadata: the text table shows them escaped and bounded.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from qscheme.cli.output import print_json, table
from qscheme.plugins import get_plugins
from qscheme.text import shown


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "plugins",
        help="list the plugins: distribution, version, kernels, schemes, errors",
        description="List every plugin, what it adds and why it failed if it did. Exit 1 when any plugin "
        "failed, 0 otherwise. QSCHEME_PLUGINS, QSCHEME_DISABLE_PLUGIN_AUTOLOAD and QSCHEME_STRICT_PLUGINS "
        "choose which plugins load (see `qscheme --help`).",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    plugins = get_plugins()
    infos = plugins.infos()
    if args.json:
        print_json([info.as_json() for info in infos])
        return 1 if plugins.failures() else 0
    rows = []
    for info in infos:
        if info.failures:
            status = "failed" if not info.loaded else "loaded, with errors"
        elif info.skipped:
            status = f"skipped ({info.skipped})"
        else:
            status = "loaded"
        rows.append(
            [
                shown(info.name),
                shown(info.distribution or "-"),
                shown(info.version or "-"),
                ", ".join(shown(kernel) for kernel in info.kernels) or "-",
                ", ".join(shown(scheme) for scheme in info.schemes) or "-",
                shown(status),
            ]
        )
    out = [table(rows, ["plugin", "distribution", "version", "kernels", "schemes", "status"])]
    failures = plugins.failures()
    if failures:
        out.extend(["", "errors:"])
        out.extend(f"  {failure}" for failure in failures)
    out.append(f"\n{len(infos)} plugins, {len(failures)} error(s)")
    sys.stdout.write("\n".join(out) + "\n")
    return 1 if failures else 0
