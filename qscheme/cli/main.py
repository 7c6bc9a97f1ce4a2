"""Entry point of the `qscheme` command: dispatches to one module per command.

Exit codes: 0 success, 1 the command's check failed (invalid descriptor, no kernel, ...) or its
output could not be written, 2 usage or input error (a bad argument, a path that does not
exist, an unknown name). Errors go to stderr as one readable message, never a traceback,
escaped and bounded (``qscheme.cli.output``); with ``--json`` a failing command also prints
``{"error": {"type", "message", "exit_code"}}`` on stdout.

Warnings: while a command runs, each warning of qscheme's own (a ``SchemePathWarning`` for a
descriptor the catalog skipped, a ``KernelRouteWarning``, ...) is shown as ``warning: MESSAGE``
on stderr, once per distinct message, without Python's source line; never on stdout, also with
``--json``. Other warnings are shown as Python shows them.

Closed streams: a stdout that cannot be written (``>&-``, a full disk) exits 1 with one line on
stderr; a pipe closed by its reader (``| head -1``) exits 1 silently; a stderr that cannot be
written (``2>&-``) changes nothing: the exit code is the command's own.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, TextIO

from qscheme import __version__
from qscheme.cli.output import GuardedOutput, TerminalOutput, bounded_message, json_output
from qscheme.errors import DestinationError, OutputError, QSchemeError

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

# Command modules under qscheme.cli, in the order `qscheme --help` lists them.
COMMANDS: tuple[str, ...] = (
    "schemes",
    "show",
    "validate",
    "kernels",
    "plugins",
    "resolve",
    "inspect",
    "run",
    "quantize",
    "convert",
)

EPILOG = """\
exit codes:
  0  success
  1  the check failed: an invalid descriptor (validate), problems in a checkpoint (inspect),
     no kernel for a layer (resolve, run), a layer beyond tolerance or whose kernel failed (run),
     a plugin that failed to load (plugins), output that could not be written (a full disk,
     a closed stdout, a pipe closed early as in `qscheme schemes | head -1`)
  2  usage or input error: a bad option value, a checkpoint folder or descriptor file that does
     not exist, an unknown scheme or kernel name
  With --json, a command that fails with an error also prints
  {"error": {"type": ..., "message": ..., "exit_code": ...}} on stdout.
  A stderr that cannot be written (2>&-) does not change the exit code.

environment:
  QSCHEME_SCHEME_PATH               folders of extra scheme descriptors (*.yaml), separated by ':'
  QSCHEME_KERNEL                    force this kernel for every layer (--kernel overrides it)
  QSCHEME_DISABLED_KERNELS          kernels never to choose, comma-separated
  QSCHEME_PLUGINS                   load only these third-party plugins (entry points or distributions, comma-separated)
  QSCHEME_STRICT_PLUGINS=1          a plugin that fails is an error instead of being skipped
  QSCHEME_STRICT_SCHEMES=1          a descriptor on QSCHEME_SCHEME_PATH that cannot be used is an error, not skipped
  QSCHEME_DISABLE_PLUGIN_AUTOLOAD=1 load no third-party plugins (only the built-in ones)
"""


class _Parser(argparse.ArgumentParser):
    def _print_message(self, message: str, file: SupportsWrite[str] | None = None) -> None:
        """argparse prints help, usage and --version here and ignores write errors; stdout gets the
        rule of every command's output instead (an OutputError, or a BrokenPipeError from a closed
        pipe). ``file`` is None when the process started with stdout closed: argparse would fall back
        to stderr."""
        if not message:
            return
        if file is not None and file is not sys.stdout:
            with contextlib.suppress(OSError, ValueError):
                file.write(message)
            return
        stdout = GuardedOutput(sys.stdout)
        stdout.write(message)
        stdout.flush()

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        sys.stderr.write(f"qscheme: error: {message}\n")
        exit_error = SystemExit(2)
        exit_error.usage_message = message  # type: ignore[attr-defined]  # for the --json error object
        raise exit_error


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="qscheme",
        description="Declarative quantization schemes, kernels and checkpoints.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"qscheme {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        module = importlib.import_module(f"qscheme.cli.{name}")
        module.register(sub)
    return parser


def _error_json(kind: str, message: str, exit_code: int) -> None:
    """The --json form of an error, on stdout (stderr has the text already)."""
    record = {"error": {"type": kind, "message": message, "exit_code": exit_code}}
    stdout = GuardedOutput(sys.stdout)
    with contextlib.suppress(OutputError, BrokenPipeError):
        stdout.write(json.dumps(record, indent=2) + "\n")
        stdout.flush()


def _discard_stdout() -> None:
    """After a write error on the real stdout, point it at /dev/null: the final flush cannot fail then."""
    real = sys.__stdout__
    if real is None:
        return
    try:
        descriptor = real.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
    except (OSError, ValueError):
        return
    os.dup2(devnull, descriptor)
    os.close(devnull)


def _reserve_closed_descriptors() -> None:
    """Point a closed descriptor 1 or 2 at /dev/null, so that no file opened later takes its number
    and receives what native code writes there (``sys.stdout`` stays None: writing is an error)."""
    for descriptor in (1, 2):
        try:
            os.fstat(descriptor)
        except OSError:
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
            except OSError:
                return
            if devnull != descriptor:
                os.dup2(devnull, descriptor)
                os.close(devnull)


def _is_qscheme_warning(category: type[Warning]) -> bool:
    module = getattr(category, "__module__", "")
    return module == "qscheme" or module.startswith("qscheme.")


@contextlib.contextmanager
def qscheme_warnings() -> Iterator[None]:
    """Show each qscheme warning raised inside as one ``warning: MESSAGE`` on stderr, once per
    distinct message (no Python source line); other warnings as before. The warning filters
    still apply (``-W ignore`` hides them); everything is restored on exit."""
    shown: set[str] = set()
    with warnings.catch_warnings():  # restores showwarning; entering it resets the once-per-location registries
        previous = warnings.showwarning

        def show(
            message: Warning | str,
            category: type[Warning],
            filename: str,
            lineno: int,
            file: TextIO | None = None,
            line: str | None = None,
        ) -> None:
            if not _is_qscheme_warning(category):
                previous(message, category, filename, lineno, file, line)
                return
            text = str(message)
            if text not in shown:
                shown.add(text)
                with contextlib.suppress(OSError, ValueError):
                    sys.stderr.write(f"warning: {text}\n")

        warnings.showwarning = show
        yield


def main(argv: Sequence[str] | None = None) -> int:
    _reserve_closed_descriptors()
    errors = TerminalOutput(sys.stderr, "stderr", required=False)
    try:
        with contextlib.redirect_stderr(errors), qscheme_warnings():
            return _run(list(sys.argv[1:] if argv is None else argv))
    finally:
        errors.flush()


def _run(arguments: list[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(arguments)
    except OutputError as exc:  # --help or --version
        _discard_stdout()
        sys.stderr.write(f"qscheme: error: {exc}\n")
        return exc.exit_code
    except BrokenPipeError:
        _discard_stdout()
        return OutputError.exit_code
    except SystemExit as exc:
        message = getattr(exc, "usage_message", None)
        if message is not None and "--json" in arguments:
            _error_json("UsageError", message, 2)
        raise
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    wants_json = bool(getattr(args, "json", False))
    stdout = GuardedOutput(sys.stdout) if wants_json else TerminalOutput(sys.stdout)
    try:
        with contextlib.redirect_stdout(stdout):
            with json_output() if wants_json else contextlib.nullcontext():
                code: int = args.handler(args)
            stdout.flush()
        return code
    except OutputError as exc:
        if not isinstance(exc, DestinationError):  # stdout itself failed: nothing more to print there
            _discard_stdout()
            sys.stderr.write(f"qscheme {args.command}: error: {exc}\n")
            return exc.exit_code
        return _report_error(args.command, exc, stdout, wants_json)
    except QSchemeError as exc:
        return _report_error(args.command, exc, stdout, wants_json)
    except BrokenPipeError:  # the reader closed the pipe (`| head`): nothing to tell it
        _discard_stdout()
        return OutputError.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130


def _report_error(command: str, exc: QSchemeError, stdout: GuardedOutput | TerminalOutput, wants_json: bool) -> int:
    """A failed command's error on stderr (and as ``--json``'s error object), after its output."""
    with contextlib.suppress(OutputError, BrokenPipeError):
        stdout.flush()  # what the command printed before it failed
    message = bounded_message(str(exc))
    sys.stderr.write(f"qscheme {command}: error: {message}\n")
    if wants_json:
        _error_json(type(exc).__name__, message, exc.exit_code)
    return exc.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
