"""Safe YAML reading that keeps every value's file:line:column.

Only the plain YAML types are allowed (mappings, sequences, strings, numbers, booleans, null):
a Python tag, an alias to a complex node or a duplicate key is a located problem, not a crash.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from qscheme.errors import Location, Problem

INVALID: object = object()
"""The value of a node whose tag was refused (already reported; readers stay silent on it)."""

_PLAIN_TAGS = {
    "tag:yaml.org,2002:str",
    "tag:yaml.org,2002:int",
    "tag:yaml.org,2002:float",
    "tag:yaml.org,2002:bool",
    "tag:yaml.org,2002:null",
    "tag:yaml.org,2002:map",
    "tag:yaml.org,2002:seq",
}


@dataclass(frozen=True)
class Node:
    """A YAML value with where it was written. ``value`` is a dict, a list or a scalar.

    ``keys`` gives, for a mapping, the line and column of each key (its value's position is the
    child node's own), so that a problem with a key itself can point at the key.
    """

    value: Any
    line: int
    column: int
    keys: dict[str, tuple[int, int]] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_mapping(self) -> bool:
        return isinstance(self.value, dict)

    @property
    def is_sequence(self) -> bool:
        return isinstance(self.value, list)

    def plain(self) -> Any:
        """The value without locations."""
        if isinstance(self.value, dict):
            return {key: node.plain() for key, node in self.value.items()}
        if isinstance(self.value, list):
            return [node.plain() for node in self.value]
        return self.value


MAX_DEPTH = 32
"""Deepest nesting of mappings and lists a descriptor may use (real ones use 5 levels)."""


def read_yaml(text: str, file: str) -> tuple[Node | None, list[Problem]]:
    """Parse YAML text into located nodes; problems instead of exceptions."""
    problems: list[Problem] = []
    loader: yaml.SafeLoader | None = None
    try:
        loader = yaml.SafeLoader(text)  # checks every character first (ReaderError)
        root = loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        location = Location(file, mark.line + 1, mark.column + 1) if mark else Location(file)
        problems.append(Problem(location, f"not valid YAML: {exc.problem or exc}"))
        return None, problems
    except yaml.reader.ReaderError as exc:
        problems.append(_reader_problem(exc, text, file))
        return None, problems
    except yaml.YAMLError as exc:
        problems.append(Problem(Location(file), f"not valid YAML: {exc}"))
        return None, problems
    except RecursionError:
        line, column = (loader.line + 1, loader.column + 1) if loader is not None else (None, None)
        problems.append(
            Problem(
                Location(file, line, column),
                f"mappings and lists are nested too deeply here; a descriptor nests at most {MAX_DEPTH} levels",
            )
        )
        return None, problems
    finally:
        if loader is not None:
            loader.dispose()
    if root is None:
        problems.append(
            Problem(
                Location(file, 1, 1), "the file is empty; a descriptor is a mapping with at least `name` and `weight`"
            )
        )
        return None, problems
    constructor = yaml.SafeLoader("")
    try:
        return _convert(root, file, constructor, problems, "", set(), 0), problems
    except _TooDeep as exc:
        return None, [*problems, exc.problem]


class _TooDeep(Exception):
    """Nesting beyond MAX_DEPTH: the whole file is refused with this one problem."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(str(problem))
        self.problem = problem


def _reader_problem(exc: yaml.reader.ReaderError, text: str, file: str) -> Problem:
    """A character PyYAML refuses (NUL, other control characters), located by its offset in the text."""
    position = max(0, min(exc.position, len(text)))
    line = text.count("\n", 0, position) + 1
    column = position - (text.rfind("\n", 0, position) + 1) + 1
    character = exc.character if isinstance(exc.character, int) else ord(str(exc.character)[:1] or "\0")
    return Problem(
        Location(file, line, column),
        f"not valid YAML: character U+{character:04X} is not allowed in YAML text; remove it "
        "(a descriptor is plain UTF-8 text: is this a binary file, or a hidden copy such as a macOS ._ file?)",
    )


def _scalar(node: yaml.ScalarNode, constructor: yaml.SafeLoader, file: str, problems: list[Problem], path: str) -> Any:
    """A scalar's value; a located problem (and INVALID) for a number Python cannot read."""
    try:
        return constructor.construct_object(node)
    except (ValueError, OverflowError, yaml.YAMLError):
        location = Location(file, node.start_mark.line + 1, node.start_mark.column + 1, path or "<top>")
        written = str(node.value)
        digits = sum(ch.isdigit() for ch in written)
        if digits > 100:
            shown = f"{written[:12]}... (a number of {digits} digits)"
            problems.append(Problem(location, f"{shown} is too large; descriptor numbers are small integers"))
        else:
            problems.append(
                Problem(
                    location,
                    f"{written!r} is not a valid number; write a decimal integer such as 16, or quote it for a string",
                )
            )
        return INVALID


def _convert(
    node: yaml.Node,
    file: str,
    constructor: yaml.SafeLoader,
    problems: list[Problem],
    path: str,
    seen: set[int],
    depth: int,
) -> Node:
    line, column = node.start_mark.line + 1, node.start_mark.column + 1
    if isinstance(node, yaml.CollectionNode):
        if depth >= MAX_DEPTH:
            shown = path if len(path) <= 60 else path[:57] + "..."
            raise _TooDeep(
                Problem(
                    Location(file, line, column, shown or "<top>"),
                    f"mappings and lists are nested more than {MAX_DEPTH} levels deep; "
                    "a descriptor needs only a few levels",
                )
            )
        if id(node) in seen:
            problems.append(
                Problem(
                    Location(file, line, column, path or "<top>"),
                    "an alias of a mapping or list (*name) is not allowed; write the value out in full",
                )
            )
            return Node(INVALID, line, column)
        seen.add(id(node))
    if node.tag not in _PLAIN_TAGS:
        problems.append(
            Problem(
                Location(file, line, column, path),
                f"tag {node.tag!r} is not allowed; descriptors are plain YAML "
                "(mappings, lists, strings, numbers, booleans, null): remove the tag",
            )
        )
        return Node(INVALID, line, column)
    if isinstance(node, yaml.MappingNode):
        items: dict[str, Node] = {}
        keys: dict[str, tuple[int, int]] = {}
        for key_node, value_node in node.value:
            key_line, key_column = key_node.start_mark.line + 1, key_node.start_mark.column + 1
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag not in _PLAIN_TAGS:
                problems.append(Problem(Location(file, key_line, key_column, path), "a key must be a plain string"))
                continue
            key_value = _scalar(key_node, constructor, file, problems, path)
            if key_value is INVALID:
                continue
            key = str(key_value)
            child_path = f"{path}.{key}" if path else key
            if key in items:
                problems.append(
                    Problem(
                        Location(file, key_line, key_column, child_path),
                        f"duplicate key {key!r} (first at line {items[key].line}); keep one",
                    )
                )
                continue
            keys[key] = (key_line, key_column)
            items[key] = _convert(value_node, file, constructor, problems, child_path, seen, depth + 1)
        return Node(items, line, column, keys)
    if isinstance(node, yaml.SequenceNode):
        return Node(
            [
                _convert(child, file, constructor, problems, f"{path}[{index}]", seen, depth + 1)
                for index, child in enumerate(node.value)
            ],
            line,
            column,
        )
    assert isinstance(node, yaml.ScalarNode)
    return Node(_scalar(node, constructor, file, problems, path), line, column)
