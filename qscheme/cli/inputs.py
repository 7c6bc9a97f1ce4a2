"""Command-line inputs that must exist: a scheme and a checkpoint folder.

An input that cannot be found is an InputError (exit code 2), told apart from a check that
ran and failed (exit code 1). The library raises SchemeError / CheckpointError for both; the
command line decides here, from the facts (is the path there, is the name in the catalog),
and re-raises the library's message as SchemeNotFoundError / CheckpointNotFoundError.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from qscheme.errors import CheckpointNotFoundError, SchemeError, SchemeNotFoundError

if TYPE_CHECKING:
    from qscheme.descriptor import Scheme


def _names_a_file(text: str) -> bool:
    """Whether ``load_scheme`` takes ``text`` as a descriptor file path rather than a name."""
    return text.endswith((".yaml", ".yml")) or (os.sep in text and Path(text).exists())


def scheme_argument(target: str) -> Scheme:
    """``load_scheme(target)``; an unknown name or a missing file is a SchemeNotFoundError (exit 2)."""
    from qscheme.catalog import load_catalog, load_scheme

    try:
        return load_scheme(target)
    except SchemeError as exc:
        if _names_a_file(target):
            missing = not Path(target).exists()
        else:
            missing = load_catalog().find(target) is None  # the same catalog error, if building it failed
        if missing:
            raise SchemeNotFoundError(str(exc)) from None
        raise


def checkpoint_argument(path: str) -> None:
    """Refuse (exit 2) a checkpoint path that does not exist or is not a folder."""
    folder = Path(path)
    if not folder.exists():
        raise CheckpointNotFoundError(f"{path}: no such folder; pass a checkpoint folder (config.json + *.safetensors)")
    if not folder.is_dir():
        raise CheckpointNotFoundError(
            f"{path}: not a folder; pass the checkpoint folder that holds config.json and *.safetensors"
        )
