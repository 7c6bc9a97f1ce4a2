"""Entry point of the `qscheme` command: dispatches to one module per command.

Exit codes: 0 success, 1 the command's check failed (invalid descriptor, no kernel, ...),
2 usage error. Errors go to stderr as one readable message, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from qscheme.errors import QSchemeError

# Command modules under qscheme.cli, in the order `qscheme --help` lists them.
COMMANDS: tuple[str, ...] = ("schemes", "show", "validate", "kernels", "plugins", "resolve", "inspect", "run")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        sys.stderr.write(f"qscheme: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="qscheme", description="Declarative quantization schemes, kernels and checkpoints.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        module = importlib.import_module(f"qscheme.cli.{name}")
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        code: int = args.handler(args)
        return code
    except QSchemeError as exc:
        sys.stderr.write(f"qscheme {args.command}: error: {exc}\n")
        return getattr(exc, "exit_code", 1)
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
