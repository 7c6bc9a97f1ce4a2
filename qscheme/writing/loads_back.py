"""Checks both writers share: boolean flags, name collisions, and the written folder loading back.

- ``check_flags``: ``force`` (and the other switches) take True or False only; ``"no"`` is truthy
  in Python and would replace a folder the caller meant to keep.
- ``refuse_collisions``: a source tensor copied through under a name the writer produces (a
  stray ``x.weight_scale`` beside a quantized ``x``) would silently replace, or be replaced by,
  the computed tensor; it is refused before anything is written, naming both.
- ``check_loads_back``: before the rename into place, the written folder goes through the
  loader's own planning (``plan_checkpoint``: producer config, shard headers, detection of every
  module's scheme, layout checks), which must find no problem and exactly the modules written,
  each in the scheme written. Each layer's values were checked as the loader checks them
  (``canonicalize``) when it was computed; together that is what ``load_checkpoint`` checks, without
  holding the whole model in memory.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path

from qscheme.api_checks import require_flag, require_optional_flag
from qscheme.errors import CheckpointError, DestinationError
from qscheme.text import shown_file
from qscheme.writing.source import SourceCheckpoint


class NameCollisionError(CheckpointError):
    """A source tensor would be copied under a name the writer produces for a quantized module."""


def check_flags(function: str, **flags: object) -> None:
    """UsageError unless ``force`` and the other flags are True or False (``progress`` may be None)."""
    for name, value in flags.items():
        if name == "progress":
            require_optional_flag(value, name, function)
        else:
            require_flag(value, name, function)


def refuse_collisions(source: SourceCheckpoint, produced: Mapping[str, str], *, consumed: Collection[str]) -> None:
    """NameCollisionError when a source tensor not in ``consumed`` (so copied through) has a name in
    ``produced`` (tensor name -> the module it is written for)."""
    found = [name for name in source.tensors if name not in consumed and name in produced]
    if not found:
        return
    first = found[0]
    info = source.tensors[first]
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    raise NameCollisionError(
        f"{shown_file(info.file)}: tensor {first!r} would be copied through, but the writer produces a tensor "
        f"of that name for the quantized module {produced[first]!r}{more}; one would replace the other. Remove the "
        f"stray tensor from the source, or leave the module unquantized with --ignore {produced[first]}; nothing "
        "was written"
    )


def check_loads_back(folder: Path, modules: Collection[str], scheme: str | Mapping[str, str]) -> None:
    """DestinationError unless the loader plans ``folder`` without problems and finds exactly
    ``modules`` quantized, each in ``scheme`` (one name, or module -> name)."""
    from qscheme.checkpoint.plan import format_problems, plan_checkpoint

    said = f"{folder}: the written checkpoint does not load back through qscheme's loader"
    try:
        plan = plan_checkpoint(folder)
    except CheckpointError as exc:
        raise DestinationError(f"{said}: {exc}; nothing was moved into place") from None
    if plan.problems:
        raise DestinationError(f"{said}:\n{format_problems(plan.problems)}\nnothing was moved into place")
    found = {module: layout.scheme.name for module, layout in plan.layouts.items()}
    missing = sorted(set(modules) - set(found))
    extra = sorted(set(found) - set(modules))
    if missing or extra:
        raise DestinationError(
            f"{said}: it finds other quantized modules than were written (not found: {missing[:5]}, not written: "
            f"{extra[:5]}); nothing was moved into place"
        )
    for module, name in found.items():
        expected = scheme if isinstance(scheme, str) else scheme[module]
        if name != expected:
            raise DestinationError(
                f"{said}: module {module} reads back as {name}, written as {expected}; nothing was moved into place"
            )
