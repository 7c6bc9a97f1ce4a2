"""`qscheme inspect CHECKPOINT [--json]`: what a checkpoint holds and what is wrong with it.

Shows the producer, the detected scheme of every quantized module (grouped, with counts), the
ignored modules, plain and tolerated tensors, and every problem found (layout and scale
values). Reads only headers and the small scale tensors. Exit 1 when problems were found, 2
when the folder does not exist.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from qscheme.cli.inputs import checkpoint_argument
from qscheme.cli.output import print_json


def register(sub: Any) -> None:
    parser = sub.add_parser("inspect", help="show what a checkpoint holds: producer, schemes per module, problems")
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint folder (config.json + *.safetensors)")
    parser.add_argument("--json", action="store_true", help="print JSON (every module listed)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from qscheme.checkpoint.inspect import inspect_checkpoint, render_inspection  # imports torch

    checkpoint_argument(args.checkpoint)
    inspection = inspect_checkpoint(args.checkpoint)
    if args.json:
        print_json(inspection.as_json())
    else:
        sys.stdout.write(render_inspection(inspection) + "\n")
    return 0 if inspection.ok else 1
