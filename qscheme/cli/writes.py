"""What `qscheme quantize` and `qscheme convert` share: running a checkpoint write and reporting it.

The write is called with the progress setting (None: a bar on a terminal, quiet otherwise; with
``--json``, a bar only when stderr is a terminal, so stdout stays JSON). A SIGTERM or SIGHUP
that stopped it exits 128 + the signal number, saying what is on disk: nothing written, or (the
signal came once the finished checkpoint was in place) DST complete.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from qscheme.cli.output import print_json

if TYPE_CHECKING:
    from qscheme.writing.summary import WriteSummary


def run_write(
    command: str,
    dst: str,
    write: Callable[[bool | None], WriteSummary],
    *,
    as_json: bool,
    details: Callable[[WriteSummary], Sequence[str]] = lambda summary: (),
) -> int:
    """Run ``write(progress)`` and print its summary (text, then ``details``' lines, or JSON)."""
    from qscheme.storage import Terminated

    try:
        summary = write(sys.stderr.isatty() if as_json else None)
    except Terminated as stop:
        if stop.committed is not None:
            state = f"the checkpoint was already complete and in place at {stop.committed}"
        else:
            state = f"nothing was written to {dst}"
        sys.stderr.write(f"qscheme {command}: {stop}; {state}\n")
        return 128 + stop.signal_number
    if as_json:
        print_json(summary.to_json())
    else:
        sys.stdout.write("\n".join([summary.render(), *details(summary)]) + "\n")
    return 0
