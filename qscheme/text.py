"""Text read from a checkpoint, made safe and short enough to show a person.

Tensor names, module names, file names, config and metadata values come from files anyone can
write. Shown raw, a name like ``"a\\x1b[2Jb"`` clears the terminal, a ``"\\r"`` or a newline forges
a line of output, and a U+202E reverses what follows it. So:

- ``escape`` writes every character that is not printable (C0 and C1 controls, DEL, line and
  paragraph separators, bidi and other format characters, lone surrogates, unassigned code
  points) as a Python escape (``\\x1b``, ``\\n``, ``\\u202e``, ``\\udc80``); printable text, other
  scripts and backslashes are left as they are.
- ``shown`` is ``escape`` plus a length bound, for one name or value inside a message;
  ``cut`` bounds any text, keeping its start and end and saying how much was cut.
- ``listing`` and ``problem_lines`` bound lists: a few names and how many more; a few problems
  of each kind and how many more like them.
- ``bounded_problem`` bounds one problem message for JSON, where it is not escaped: every long
  quoted name in it is cut where it stands (its start and end kept), then the whole message.

Where they are applied: ``shown`` where a name is formatted into text (``listing`` does it for
every name it lists), and the command's output streams (``qscheme.cli.output.TerminalOutput``)
escape everything but the newlines that separate lines, as a backstop for names formatted
elsewhere. JSON output needs neither: ``json.dumps`` escapes control characters itself.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

NAME_LIMIT = 200  # characters of one name or value shown in a message
_SHORT_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped_char(char: str) -> str:
    short = _SHORT_ESCAPES.get(char)
    if short is not None:
        return short
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def escape(text: str, keep: str = "") -> str:
    """``text`` with every non-printable character escaped, except those in ``keep`` (e.g. ``"\\n"``)."""
    if text.isprintable():  # the common case, checked in C
        return text
    return "".join(char if char.isprintable() or char in keep else _escaped_char(char) for char in text)


def _cut(text: str, limit: int, escaped: bool) -> str:
    tail = limit // 3
    head = limit - tail
    start, end = text[:head], text[len(text) - tail :] if tail else ""
    if escaped:
        start, end = escape(start), escape(end)
    return f"{start}... [{len(text) - head - tail:,} characters cut] ...{end}"


def cut(text: str, limit: int) -> str:
    """``text`` if it has at most ``limit`` characters, else its start and end around
    ``... [1,048,376 characters cut] ...`` (the marker is not counted in ``limit``)."""
    return text if len(text) <= limit else _cut(text, limit, escaped=False)


def shown(value: object, limit: int = NAME_LIMIT) -> str:
    """One untrusted name or value as it may appear in a message: escaped, at most ``limit``
    characters of it kept. Cut before escaping, so the count is of the value's own characters."""
    text = value if isinstance(value, str) else str(value)
    return escape(text) if len(text) <= limit else _cut(text, limit, escaped=True)


def shown_file(path: Path) -> str:
    """A checkpoint file's path for a message, its name (which the checkpoint chose) escaped and bounded."""
    name = shown(path.name)
    return str(path) if name == path.name else str(path.with_name(name))


def listing(names: Sequence[str], limit: int, sentence: bool = False) -> str:
    """``a, b, ... (3 more)``; with ``sentence``, ``a, b and 3 more`` (for prose). Each name is
    passed through ``shown``."""
    shown_names = ", ".join(shown(name) for name in names[:limit])
    if len(names) <= limit:
        return shown_names
    rest = len(names) - limit
    return f"{shown_names} and {rest:,} more" if sentence else f"{shown_names}, ... ({rest:,} more)"


_QUOTED = re.compile(r"'(?:[^'\\\n]|\\.)*'|\"(?:[^\"\\\n]|\\.)*\"")
_NUMBER = re.compile(r"\d+")


def bounded_problem(text: str, name_limit: int, limit: int) -> str:
    """``text`` with every quoted name longer than ``name_limit`` cut (``cut``, quotes kept), then
    the whole cut to ``limit``: a message naming two long tensors keeps the start and end of both."""
    if len(text) <= name_limit:
        return text

    def name(match: re.Match[str]) -> str:
        quoted = match.group()
        if len(quoted) <= name_limit + 2:
            return quoted
        return quoted[0] + cut(quoted[1:-1], name_limit) + quoted[-1]

    return cut(_QUOTED.sub(name, text), limit)


def problem_kind(problem: object) -> str:
    """What problems that differ only in names and numbers have in common: the message with
    every quoted name and every number blanked (a problem's ``message`` where it has one, so that
    its file and tensor do not count)."""
    message = getattr(problem, "message", None)
    text = message if isinstance(message, str) else str(problem)
    return _NUMBER.sub("#", _QUOTED.sub("'?'", text))


def problem_lines(
    problems: Sequence[object],
    per_kind: int = 3,
    max_kinds: int | None = None,
    bullet: str = "  - ",
    rest_hint: str = "",
) -> list[str]:
    """The problems as bullet lines, grouped by ``problem_kind`` in first-seen order: the first
    ``per_kind`` of each kind, then ``... and 4,997 more like this``. With ``max_kinds``, the kinds
    after that many are one line, ``... and 12 more problems of 3 other kinds``, followed by
    ``rest_hint``. A problem that spans several lines has its later lines indented under it."""
    groups: dict[str, list[object]] = {}
    for problem in problems:
        groups.setdefault(problem_kind(problem), []).append(problem)
    indent = " " * len(bullet)
    lines: list[str] = []
    kinds = list(groups.values())
    shown_kinds = kinds if max_kinds is None else kinds[:max_kinds]
    for group in shown_kinds:
        for problem in group[:per_kind]:
            first, *rest = str(problem).split("\n")
            lines.append(bullet + first)
            lines.extend(indent + line for line in rest)
        if len(group) > per_kind:
            lines.append(f"{indent}... and {len(group) - per_kind:,} more like this")
    hidden = kinds[len(shown_kinds) :]
    if hidden:
        count = sum(len(group) for group in hidden)
        kinds_text = "kind" if len(hidden) == 1 else "kinds"
        lines.append(
            f"{bullet[: len(bullet) - len(bullet.lstrip())]}... and {count:,} more problem{'s' if count != 1 else ''} "
            f"of {len(hidden):,} other {kinds_text}{rest_hint}"
        )
    return lines


# Module names whose numbered children are a MoE block's experts (``...mlp.experts.<e>.down_proj``).
EXPERT_CONTAINERS = ("experts",)
_EXPERT_INDEX = re.compile(r"(?:^|\.)(?:" + "|".join(EXPERT_CONTAINERS) + r")\.(\d+)(?=\.|$)")


def expert_index_range(names: Sequence[str]) -> str | None:
    """``{0..7}`` for names whose experts are 0 to 7, ``{0,2,5}`` for a gappy set (a few then
    ``...``); None when the names are not experts' layers."""
    indices: set[int] = set()
    for name in names:
        found = _EXPERT_INDEX.search(name)
        if found is None:
            return None
        indices.add(int(found.group(1)))
    ordered = sorted(indices)
    if not ordered:
        return None
    if ordered == list(range(ordered[0], ordered[-1] + 1)) and len(ordered) > 1:
        return f"{{{ordered[0]}..{ordered[-1]}}}"
    shown_indices = ",".join(str(index) for index in ordered[:8]) + (",..." if len(ordered) > 8 else "")
    return f"{{{shown_indices}}}"


def group_label(pattern: str, names: Sequence[str]) -> str:
    """A grouping pattern (``model.layers.*.mlp.experts.*.gate_proj``) with its experts' index
    written as the range the group's ``names`` hold (``model.layers.*.mlp.experts.{0..7}.gate_proj``),
    so a MoE model's experts read as one row that says how many there are."""
    indices = expert_index_range(names)
    if indices is None:
        return pattern
    for container in EXPERT_CONTAINERS:
        marker = f"{container}.*"
        at = pattern.find(marker)
        if at >= 0 and (at == 0 or pattern[at - 1] == "."):
            end = at + len(marker)
            return pattern[: end - 1] + indices + pattern[end:]
    return pattern


def expert_blocks(names: Sequence[str]) -> dict[str, list[str]]:
    """Experts' layer names by their MoE block, with the index written as a range:
    ``{"model.layers.0.mlp.experts.{0..7}": [...names...]}``; other names are left out."""
    blocks: dict[str, list[str]] = {}
    for name in names:
        found = _EXPERT_INDEX.search(name)
        if found is not None:
            blocks.setdefault(name[: found.start(1)].rstrip("."), []).append(name)
    return {f"{block}.{expert_index_range(members)}": members for block, members in blocks.items()}
