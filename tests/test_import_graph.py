"""No import cycles among the modules of ``qscheme`` and ``qscheme_plugins``.

The graph is built from the source with ``ast``, not by importing: an edge runs from a module to
every module of the two packages it imports, at module level or inside a function (a function-level
import is a cycle that is only postponed). Imports under ``if TYPE_CHECKING:`` are left out: they
never run. ``import a.b`` and ``from a import b`` name ``a.b`` when that is a module, and
``from a.b import name`` names ``a.b`` (the package's ``__init__`` when ``a.b`` is one). Importing
``a.b.c`` also runs the ``__init__`` of ``a.b``, so that package is an edge too, unless it contains
the importer (its ``__init__`` is then already running). Dynamic imports
(``importlib.import_module`` of a computed name, entry points) are not edges.

A strongly connected component with more than one module is a cycle and fails the test, unless
the imports listed in ``ALLOWED``, each with its reason, break it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Installed package name -> folder in the tree (setup.py installs plugins/ as qscheme_plugins).
PACKAGE_FOLDERS = {"qscheme": ROOT / "qscheme", "qscheme_plugins": ROOT / "plugins"}

# Imports that may point back up the graph, (importer, module the import names) -> why. The graph
# less these imports must have no cycle; every entry must still exist and be needed.
ALLOWED: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    """One edge: a statement of ``importer`` that runs ``imported``, a module it names or a package
    above one (``named``)."""

    importer: str
    imported: str
    named: str
    path: Path
    line: int
    text: str

    def describe(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: {self.text}"


def module_files() -> dict[str, Path]:
    """Every module of the two packages by its installed dotted name."""
    modules: dict[str, Path] = {}
    for package, folder in PACKAGE_FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def is_type_checking_guard(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree``, at any depth, except under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and is_type_checking_guard(node):
            pending.extend(node.orelse)
            continue
        pending.extend(ast.iter_child_nodes(node))
    return found


def imported_modules(
    node: ast.Import | ast.ImportFrom, importer: str, is_package: bool, modules: dict[str, Path]
) -> set[str]:
    """The modules of the two packages that one import statement names."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    base = node.module or ""
    if node.level:
        parts = importer.split(".")
        if not is_package:
            parts.pop()
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join([*parts, base]) if base else ".".join(parts)
    targets: set[str] = set()
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        if submodule in modules:
            targets.add(submodule)
        elif base in modules:
            targets.add(base)
    return targets


def packages_run_before(named: str, importer: str, modules: dict[str, Path]) -> list[str]:
    """The packages whose ``__init__`` importing ``named`` runs first, less those that contain the
    importer (already running when it runs)."""
    parts = named.split(".")
    above = [".".join(parts[:end]) for end in range(1, len(parts))]
    return [package for package in above if package in modules and not importer.startswith(package + ".")]


def import_graph() -> dict[str, list[Import]]:
    """For each module, its imports of other modules of the two packages."""
    modules = module_files()
    graph: dict[str, list[Import]] = {}
    for name, path in modules.items():
        source = path.read_text()
        lines = source.splitlines()
        edges: list[Import] = []
        is_package = path.name == "__init__.py"
        for node in import_nodes(ast.parse(source, filename=str(path))):
            text = lines[node.lineno - 1].strip()
            for named in imported_modules(node, name, is_package, modules):
                for target in {named, *packages_run_before(named, name, modules)} - {name}:
                    edges.append(Import(name, target, named, path, node.lineno, text))
        graph[name] = sorted(set(edges), key=lambda edge: (edge.line, edge.imported, edge.named))
    return graph


def strongly_connected_components(graph: dict[str, list[Import]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of more than one module, sorted."""
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, int]] = [(start, 0)]
        while work:
            node, position = work.pop()
            if position == 0:
                index[node] = lowlink[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            successors = [edge.imported for edge in graph[node]]
            if position < len(successors):
                work.append((node, position + 1))
                successor = successors[position]
                if successor not in index:
                    work.append((successor, 0))
                elif successor in on_stack:
                    lowlink[node] = min(lowlink[node], index[successor])
                continue
            if lowlink[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
            if work:
                parent = work[-1][0]
                lowlink[parent] = min(lowlink[parent], lowlink[node])
    return sorted(components)


def cycles_left(graph: dict[str, list[Import]], allowed: set[tuple[str, str]]) -> list[list[str]]:
    """The components that remain once the allowed edges are taken out of the graph."""
    pruned = {
        name: [edge for edge in edges if (edge.importer, edge.named) not in allowed] for name, edges in graph.items()
    }
    return strongly_connected_components(pruned)


def describe_component(component: list[str], graph: dict[str, list[Import]]) -> str:
    members = set(component)
    lines = [f"cycle among {len(component)} modules: {', '.join(component)}"]
    for name in component:
        for edge in graph[name]:
            if edge.imported in members:
                via = "" if edge.named == edge.imported else f" (its __init__ runs to import {edge.named})"
                lines.append(f"  {edge.importer} -> {edge.imported}{via}   {edge.describe()}")
    return "\n".join(lines)


def test_no_import_cycles() -> None:
    graph = import_graph()
    components = cycles_left(graph, set(ALLOWED))
    report = "\n\n".join(describe_component(component, graph) for component in components)
    assert not components, (
        f"import cycles (function-level imports count; move the shared piece into a lower "
        f"module, or list the upward import in ALLOWED with its reason):\n\n{report}"
    )


def test_every_allowed_import_exists_and_is_needed() -> None:
    """An entry of ALLOWED whose import is gone, or whose cycle is gone, is stale: remove it."""
    graph = import_graph()
    edges = {(edge.importer, edge.named) for edges in graph.values() for edge in edges}
    gone = [pair for pair in ALLOWED if pair not in edges]
    assert not gone, f"ALLOWED lists imports that no longer exist; remove them: {gone}"
    needless = [pair for pair in ALLOWED if not cycles_left(graph, set(ALLOWED) - {pair})]
    assert not needless, f"ALLOWED lists imports that close no cycle any more; remove them: {needless}"


def test_graph_sees_function_level_imports_and_skips_type_checking() -> None:
    """The builder itself: a function-level import counts (relative ones too), a TYPE_CHECKING
    one does not, and importing a module runs the packages above it that hold other modules."""
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from qscheme.checkpoint.load import Checkpoint\n"
        "def f():\n"
        "    from qscheme import errors\n"
        "    from .. import catalog\n"
    )
    modules = module_files()
    found: set[str] = set()
    for node in import_nodes(tree):
        found |= imported_modules(node, "qscheme.kernels.render", False, modules)
    assert found == {"qscheme.errors", "qscheme.catalog"}
    assert packages_run_before("qscheme.quantize.write", "qscheme.canonical", modules) == ["qscheme.quantize"]
    assert packages_run_before("qscheme.quantize.write", "qscheme.quantize.weight", modules) == []
    assert packages_run_before("qscheme.catalog", "qscheme_plugins.marlin", modules) == ["qscheme"]


def test_a_new_cycle_fails_and_names_its_imports() -> None:
    """On a made-up graph: a -> b -> c -> a is one cycle, reported with each import's line;
    allowing c -> a breaks it."""
    here = ROOT / "qscheme" / "errors.py"

    def edge(importer: str, imported: str, line: int) -> Import:
        return Import(importer, imported, imported, here, line, f"from {imported} import x")

    graph = {
        "a": [edge("a", "b", 1)],
        "b": [edge("b", "c", 2), edge("b", "d", 3)],
        "c": [edge("c", "a", 4)],
        "d": [],
    }
    assert cycles_left(graph, set()) == [["a", "b", "c"]]
    report = describe_component(["a", "b", "c"], graph)
    assert "c -> a   qscheme/errors.py:4: from a import x" in report
    assert "d" not in report.split("\n", 1)[1]
    assert cycles_left(graph, {("c", "a")}) == []


if __name__ == "__main__":
    whole = import_graph()
    for found_component in strongly_connected_components(whole):
        print(describe_component(found_component, whole), end="\n\n")
