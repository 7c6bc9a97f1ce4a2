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


def read_yaml(text: str, file: str) -> tuple[Node | None, list[Problem]]:
    """Parse YAML text into located nodes; problems instead of exceptions."""
    problems: list[Problem] = []
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        location = Location(file, mark.line + 1, mark.column + 1) if mark else Location(file)
        problems.append(Problem(location, f"not valid YAML: {exc.problem or exc}"))
        return None, problems
    except yaml.YAMLError as exc:
        problems.append(Problem(Location(file), f"not valid YAML: {exc}"))
        return None, problems
    if root is None:
        problems.append(
            Problem(
                Location(file, 1, 1), "the file is empty; a descriptor is a mapping with at least `name` and `weight`"
            )
        )
        return None, problems
    constructor = yaml.SafeLoader("")
    return _convert(root, file, constructor, problems, "", set()), problems


def _convert(
    node: yaml.Node, file: str, constructor: yaml.SafeLoader, problems: list[Problem], path: str, seen: set[int]
) -> Node:
    line, column = node.start_mark.line + 1, node.start_mark.column + 1
    if isinstance(node, yaml.CollectionNode):
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
            key = str(constructor.construct_object(key_node))
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
            items[key] = _convert(value_node, file, constructor, problems, child_path, seen)
        return Node(items, line, column, keys)
    if isinstance(node, yaml.SequenceNode):
        return Node(
            [
                _convert(child, file, constructor, problems, f"{path}[{index}]", seen)
                for index, child in enumerate(node.value)
            ],
            line,
            column,
        )
    return Node(constructor.construct_object(node), line, column)
