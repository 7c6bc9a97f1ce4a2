"""A checkpoint folder named on the command line must exist.

An input that cannot be found is an InputError (exit code 2), told apart from a check that
ran and failed (exit code 1): the catalog raises SchemeNotFoundError for an unknown name or a
missing descriptor file; a checkpoint path is checked here, before anything is read.
"""

from __future__ import annotations

from pathlib import Path

from qscheme.errors import CheckpointNotFoundError, UsageError
from qscheme.producers.gguf.config import is_gguf_file
from qscheme.text import shown


def checkpoint_argument(path: str) -> None:
    """Refuse (exit 2) a checkpoint path that is empty (``Path("")`` is the current folder), does
    not exist or is neither a folder nor a GGUF file."""
    if path == "":
        raise UsageError(
            "CHECKPOINT is empty (''), which would name the current folder; pass the checkpoint folder "
            "(config.json + *.safetensors), or '.' for the current folder"
        )
    folder = Path(path)
    named = shown(path, limit=1000)
    if not folder.exists():
        raise CheckpointNotFoundError(
            f"{named}: no such folder; pass a checkpoint folder (config.json + *.safetensors)"
        )
    if not folder.is_dir():
        if is_gguf_file(folder):
            return  # one GGUF file (llama.cpp) is a checkpoint too
        raise CheckpointNotFoundError(
            f"{named}: not a folder; pass the checkpoint folder that holds config.json and *.safetensors"
        )
