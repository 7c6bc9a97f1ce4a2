"""`qscheme inspect CHECKPOINT [--tp N|auto [--device D]] [--json]`: what a checkpoint holds and what is wrong with it.

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

``--tp N`` adds, for a checkpoint without problems, how every layer splits N ways (each
tensor's slice, shard shapes, each shard's kernel and the rejections at that degree; exit 1
when a layer cannot split or has no kernel); ``--tp auto`` the degrees where all of them do.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from qscheme.cli.inputs import checkpoint_argument
from qscheme.cli.output import print_json
from qscheme.cli.resolve import parse_tp
from qscheme.errors import UsageError
from qscheme.kernels.devices import DEVICE_CHOICES
from qscheme.producers.gguf.config import is_gguf_file
from qscheme.text import NAME_LIMIT, bounded_problem, escape, shown

if TYPE_CHECKING:
    from qscheme.checkpoint.inspect import Inspection

JSON_PROBLEMS = 1000  # problems listed by --json
JSON_NAME_LIMIT = 2000  # characters of one quoted name in a --json problem: longer than any name load accepts
JSON_PROBLEM_LIMIT = 8000  # characters of one --json problem


def register(sub: Any) -> None:
    parser = sub.add_parser("inspect", help="show what a checkpoint holds: producer, schemes per module, problems")
    parser.add_argument(
        "checkpoint", metavar="CHECKPOINT", help="a checkpoint folder (config.json + *.safetensors), or a .gguf file"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help=f"print JSON (every module listed; at most {JSON_PROBLEMS:,} problems, each bounded, "
        "with problem_count and problems_cut)",
    )
    parser.add_argument(
        "--tp",
        default=None,
        metavar="N|auto",
        help="also show how every layer splits N ways (tensor parallel): each tensor's slice, the shard "
        "shapes, each shard's kernel and what rejects kernels at that degree; 'auto' lists the degrees "
        "at which every layer splits and has a kernel",
    )
    parser.add_argument(
        "--device",
        choices=DEVICE_CHOICES,
        default=None,
        help="with --tp: the device whose kernels the shards are resolved on (default: probe this machine)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from qscheme.checkpoint.inspect import inspect_checkpoint, render_inspection  # imports torch

    checkpoint_argument(args.checkpoint)
    tp = getattr(args, "tp", None)  # a Namespace built by hand (tests, embedders) may lack the --tp options
    if getattr(args, "device", None) is not None and tp is None:
        raise UsageError("--device: only with --tp (inspect resolves kernels only for the shards of --tp)")
    if tp is not None and is_gguf_file(args.checkpoint):
        raise UsageError(f"--tp: tensor parallelism is not offered for GGUF files ({args.checkpoint}); drop --tp")
    degree = parse_tp(tp) if tp is not None else None  # a bad --tp fails before any reading
    inspection = inspect_checkpoint(args.checkpoint)
    if tp is None or not inspection.ok:
        if args.json:
            print_json(_bounded_json(inspection))
        else:
            sys.stdout.write(render_inspection(_for_terminal(inspection)) + "\n")
        return 0 if inspection.ok else 1
    return _run_tp(args, inspection, degree)


def _run_tp(args: argparse.Namespace, inspection: Inspection, degree: int | None) -> int:
    """The inspection, then the split of every layer at ``degree`` (or every degree's verdict)."""
    from qscheme.checkpoint.inspect import render_inspection
    from qscheme.kernels import registry
    from qscheme.parallel.plan import checked_tp_plan, shard_layers
    from qscheme.parallel.report import auto_json, render_auto, render_splits, render_tp, tp_json
    from qscheme.parallel.resolve import auto_degrees, resolve_tp

    device = registry.device_for(args.device)
    target = args.checkpoint
    if degree is None:
        _, verdicts = auto_degrees(target, device=device)
        section = auto_json(target, verdicts, device.describe())
        text = render_auto(target, verdicts, device.describe())
        ok = any(v.ok and v.tp_size > 1 for v in verdicts)
    else:
        plan, decisions = resolve_tp(target, degree, device=device)
        shards, _ = shard_layers(plan, checked_tp_plan(None), degree)
        section = {
            **tp_json(target, degree, decisions, device.describe()),
            "splits": [shard.as_json() for shard in shards.values()],
        }
        text = (
            render_splits(degree, list(shards.values()))
            + "\n\n"
            + render_tp(target, degree, decisions, device.describe())
        )
        ok = all(d.ok for d in decisions)
    if args.json:
        print_json({**_bounded_json(inspection), "tensor_parallel": section})
    else:
        sys.stdout.write(render_inspection(_for_terminal(inspection)) + "\n\n" + text + "\n")
    return 0 if ok else 1


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
