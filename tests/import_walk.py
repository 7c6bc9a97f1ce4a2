"""Walking qscheme's imports from the source (ast), for the layering tests of modules/, storage/
and producers/: function-level and TYPE_CHECKING imports count, relative imports are refused."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "qscheme"


def module_file(name: str) -> Path | None:
    """The file of module ``name`` of the qscheme package (its __init__.py for a package)."""
    parts = name.split(".")[1:]
    folder = ROOT.joinpath(*parts)
    if (folder / "__init__.py").is_file():
        return folder / "__init__.py"
    path = folder.with_suffix(".py")
    return path if parts and path.is_file() else None


def import_nodes(path: Path) -> list[ast.Import | ast.ImportFrom]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def imports(path: Path) -> set[str]:
    """Every qscheme module one file imports, at any depth (TYPE_CHECKING blocks included)."""
    found: set[str] = set()
    for node in import_nodes(path):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        else:
            assert not node.level, f"{path}:{node.lineno}: qscheme imports absolutely"
            base = node.module or ""
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {module for module in found if module.split(".")[0] == "qscheme" and module_file(module) is not None}


def closure(start: Iterable[str], skip: Iterable[str] = ()) -> dict[str, str]:
    """Every qscheme module reachable from ``start`` by imports (not through ``skip``), each with
    one module importing it."""
    skipped = set(skip)
    reached: dict[str, str] = {name: "" for name in start}
    pending = list(reached)
    while pending:
        name = pending.pop()
        path = module_file(name)
        assert path is not None, name
        for imported in sorted(imports(path)):
            if imported not in skipped and imported not in reached:
                reached[imported] = name
                pending.append(imported)
    return reached


def chains(reached: dict[str, str], names: Iterable[str]) -> str:
    """For each of ``names``, the import chain back to a start module, one a line."""
    lines = []
    for name in names:
        chain = [name]
        while reached[chain[-1]]:
            chain.append(reached[chain[-1]])
        lines.append(" <- ".join(chain))
    return "\n".join(lines)
