"""A test plugin that writes to stdout: at import and in a hook, with print() and straight to
file descriptor 1 (as native code would). ``qscheme ... --json`` must keep all of it off stdout.

Found through ``qscheme_noisy_plugin-0.1.0.dist-info`` when this folder is on PYTHONPATH.
"""

from __future__ import annotations

import os

from qscheme.plugins import hookimpl

print("NOISY PLUGIN IMPORTED")
os.write(1, b"NOISY PLUGIN NATIVE WRITE\n")


@hookimpl
def qscheme_kernels() -> list[object]:
    print("NOISY PLUGIN HOOK \x1b[2J")
    os.write(1, b"NOISY PLUGIN HOOK NATIVE WRITE\n")
    return []
