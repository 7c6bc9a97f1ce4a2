"""JSON files: read strictly (file:line:column, duplicate keys refused), written as transformers does.

``read_json`` is how every JSON file a checkpoint holds is read (config.json, hf_quant_config.json,
the safetensors index, a calibration file); ``file_problem`` says why a path is not a regular
file; ``write_json`` writes a config or an index (indent 2, sorted keys, final newline).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from qscheme.errors import CheckpointError, DestinationError


def file_problem(path: Path) -> str | None:
    """Why ``path`` cannot be read as a regular file ("missing", "a folder", ...); None when it can.

    Symbolic links to regular files are fine; a link whose target is gone is "a broken symbolic link";
    a name with a NUL character or an unpaired surrogate (from a JSON index) is a problem, not a crash.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a broken symbolic link" if os.path.islink(path) else "missing"
    except NotADirectoryError:
        return "missing"
    except OSError as exc:
        return f"not accessible ({exc.strerror})"
    except ValueError:  # a NUL character, or a lone surrogate the file system encoding cannot write
        return "a name no file can have (it holds a NUL character or an unpaired surrogate)"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a folder, not a file"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe), not a regular file"
    if stat.S_ISSOCK(mode):
        return "a socket, not a regular file"
    return "a device or other special file, not a regular file"


def config_file_present(path: Path) -> bool:
    """True for a regular file, False when nothing is there; CheckpointError for anything else."""
    problem = file_problem(path)
    if problem == "missing":
        return False
    if problem is not None:
        raise CheckpointError(
            f"{path}: is {problem}; a checkpoint's {path.name} must be a regular JSON file: "
            "replace it with the producer's file, or remove it"
        )
    return True


class _DuplicateKey(Exception):
    def __init__(self, key: str, keys: list[str]) -> None:
        super().__init__(key)
        self.key = key
        self.keys = keys


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key, [k for k, _ in pairs])
        out[key] = value
    return out


def read_json(path: Path) -> Any:
    """Parse a JSON file; CheckpointError with file:line:column on a syntax error.

    A leading UTF-8 byte-order mark is accepted; a key repeated within one object, nesting
    too deep for the parser and integers too long to convert are errors naming the file.
    """
    problem = file_problem(path)
    if problem is not None:
        raise CheckpointError(f"{path}: cannot be read: it is {problem}")
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read: {exc.strerror}") from None
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}") from None
    except _DuplicateKey as exc:
        others = [k for k in dict.fromkeys(exc.keys) if k != exc.key]
        shown = ", ".join(repr(k) for k in others[:3]) + (", ..." if len(others) > 3 else "")
        raise CheckpointError(
            f"{path}: key {exc.key!r} appears more than once in one JSON object"
            + (f" (the object holding {shown})" if others else "")
            + "; JSON readers silently keep only the last one: keep the entry that describes these weights "
            "and delete the other"
        ) from None
    except RecursionError:
        raise CheckpointError(
            f"{path}: invalid JSON: arrays or objects nested too deeply to parse; this is not a checkpoint "
            "config: replace the file with the producer's"
        ) from None
    except ValueError as exc:  # an integer with more digits than Python converts (4300)
        if "digits" in str(exc):
            raise CheckpointError(
                f"{path}: invalid JSON value: a number has more than 4300 digits; no config value is that "
                "large: fix the number or replace the file with the producer's"
            ) from None
        raise CheckpointError(f"{path}: invalid JSON value: {exc}") from None


def write_json(path: str | Path, value: object) -> None:
    """A JSON file as transformers writes its configs (indent 2, sorted keys, final newline)."""
    path = Path(path)
    try:
        path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    except OSError as exc:
        raise DestinationError(f"{path}: cannot write: {exc.strerror}") from None
