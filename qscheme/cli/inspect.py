"""`qscheme inspect CHECKPOINT [--json]`: what a checkpoint holds and what is wrong with it.

Shows the producer, the detected scheme of every quantized module (grouped, with counts), the
ignored modules, plain and tolerated tensors, and every problem found (layout and scale
values). Reads only headers and the small scale tensors. Exit 1 when problems were found, 2
when the folder does not exist.

Text output shows every name read from the checkpoint escaped and bounded (``_for_terminal``):
a tensor or module name cannot move the cursor, clear the screen or forge a line.

``--json`` lists every problem on its own (not grouped), each message bounded: a quoted name in
it longer than 2,000 characters (a config value; no tensor name load accepts is that long)
keeps its start and end around ``... [N characters cut] ...``, and a message longer than 8,000
characters is cut the same way. At most 1,000 problems are listed: ``problem_count`` says how
many were found, ``problems_cut`` how many of them are not listed.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from qscheme.checkpoint.text import NAME_LIMIT, bounded_problem, escape, shown
from qscheme.cli.inputs import checkpoint_argument
from qscheme.cli.output import print_json

if TYPE_CHECKING:
    from qscheme.checkpoint.inspect import Inspection

JSON_PROBLEMS = 1000  # problems listed by --json
JSON_NAME_LIMIT = 2000  # characters of one quoted name in a --json problem: longer than any name load accepts
JSON_PROBLEM_LIMIT = 8000  # characters of one --json problem


def register(sub: Any) -> None:
    parser = sub.add_parser("inspect", help="show what a checkpoint holds: producer, schemes per module, problems")
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint folder (config.json + *.safetensors)")
    parser.add_argument(
        "--json",
        action="store_true",
        help=f"print JSON (every module listed; at most {JSON_PROBLEMS:,} problems, each bounded, "
        "with problem_count and problems_cut)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from qscheme.checkpoint.inspect import inspect_checkpoint, render_inspection  # imports torch

    checkpoint_argument(args.checkpoint)
    inspection = inspect_checkpoint(args.checkpoint)
    if args.json:
        print_json(_bounded_json(inspection))
    else:
        sys.stdout.write(render_inspection(_for_terminal(inspection)) + "\n")
    return 0 if inspection.ok else 1


def _bounded_json(inspection: Inspection) -> dict[str, object]:
    problems = inspection.problems
    listed = [bounded_problem(problem, JSON_NAME_LIMIT, JSON_PROBLEM_LIMIT) for problem in problems[:JSON_PROBLEMS]]
    return {
        **inspection.as_json(),
        "problems": listed,
        "problem_count": len(problems),
        "problems_cut": len(problems) - len(listed),
    }


def _names(values: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(shown(value) for value in values)


def _optional(value: str | None, limit: int = NAME_LIMIT) -> str | None:
    return None if value is None else shown(value, limit)


def _for_terminal(inspection: Inspection) -> Inspection:
    """A copy whose names and values from the checkpoint are escaped (newlines included) and cut
    to ``NAME_LIMIT``; the notes and problems, which are messages, keep the newlines qscheme put
    in them, and quote the names in them (``repr``), which escapes them already."""
    return replace(
        inspection,
        path=shown(inspection.path, limit=1000),
        producer=shown(inspection.producer),
        files=_names(inspection.files),
        modules=[
            replace(row, module=shown(row.module), scheme=shown(row.scheme), origin=shown(row.origin))
            for row in inspection.modules
        ],
        ignored={shown(module): pattern for module, pattern in inspection.ignored.items()},
        plain=_names(inspection.plain),
        kv_cache=_names(inspection.kv_cache),
        tolerated=_names(inspection.tolerated),
        unused_targets=_names(inspection.unused_targets),
        fused=[(shown(name), _names(members)) for name, members in inspection.fused],
        notes=[escape(note, keep="\n") for note in inspection.notes],
        problems=[escape(problem, keep="\n") for problem in inspection.problems],
        producer_version=_optional(inspection.producer_version),
        producer_note=_optional(inspection.producer_note, limit=1000),
        config_file=_optional(inspection.config_file),
    )
