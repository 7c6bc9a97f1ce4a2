"""qscheme.storage: the layer that reads and writes files sits below checkpoint/, writing/ and parallel/."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import qscheme.storage

ROOT = Path(__file__).resolve().parent.parent / "qscheme"
STORAGE = ROOT / "storage"
# What the storage layer must never import, at module level or inside a function, directly or
# through another module: the layers that use it.
ABOVE = ("qscheme.checkpoint", "qscheme.parallel", "qscheme.writing", "qscheme.transformers")
# The packages that read and write files through storage's public names.
USERS = ("checkpoint", "writing", "parallel")


def _module_file(name: str) -> Path | None:
    """The file of module ``name`` of the qscheme package (its __init__.py for a package)."""
    parts = name.split(".")[1:]
    folder = ROOT.joinpath(*parts)
    if (folder / "__init__.py").is_file():
        return folder / "__init__.py"
    path = folder.with_suffix(".py")
    return path if parts and path.is_file() else None


def _import_nodes(path: Path) -> list[ast.Import | ast.ImportFrom]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def _imports(path: Path) -> set[str]:
    """Every qscheme module one file imports, at any depth (TYPE_CHECKING blocks included)."""
    found: set[str] = set()
    for node in _import_nodes(path):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        else:
            assert not node.level, f"{path}:{node.lineno}: qscheme imports absolutely"
            base = node.module or ""
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {module for module in found if module.split(".")[0] == "qscheme" and _module_file(module) is not None}


def _storage_modules() -> list[str]:
    return ["qscheme.storage"] + [f"qscheme.storage.{path.stem}" for path in sorted(STORAGE.glob("[!_]*.py"))]


def _closure(start: list[str]) -> dict[str, str]:
    """Every qscheme module reachable from ``start`` by imports, each with one module importing it."""
    reached: dict[str, str] = {name: "" for name in start}
    pending = list(start)
    while pending:
        name = pending.pop()
        path = _module_file(name)
        assert path is not None, name
        for imported in sorted(_imports(path)):
            if imported not in reached:
                reached[imported] = name
                pending.append(imported)
    return reached


def test_storage_imports_nothing_of_the_layers_above() -> None:
    start = _storage_modules()
    assert {"qscheme.storage.safetensors_reader", "qscheme.storage.shards", "qscheme.storage.json_files"} <= set(start)
    reached = _closure(start)
    above = sorted(name for name in reached if name.startswith(ABOVE))
    chains = []
    for name in above:
        chain = [name]
        while reached[chain[-1]]:
            chain.append(reached[chain[-1]])
        chains.append(" <- ".join(chain))
    assert not above, "the storage layer reaches a layer above it:\n" + "\n".join(chains)


def test_the_closure_sees_function_level_imports(tmp_path: Path) -> None:
    """The walker finds an import inside a function (what the test above relies on)."""
    source = tmp_path / "probe.py"
    source.write_text("def f():\n    from qscheme.writing.verify import verify_folder\n")
    assert "qscheme.writing.verify" in _imports(source)


def test_the_layers_above_use_only_storage_public_names() -> None:
    """checkpoint/, writing/ and parallel/ import storage's package names, never a storage module."""
    misuses = []
    for package in USERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in _import_nodes(path):
                if isinstance(node, ast.ImportFrom):
                    named = [node.module or ""]
                    if node.module == "qscheme.storage":
                        private = [alias.name for alias in node.names if alias.name not in qscheme.storage.__all__]
                        named = [f"qscheme.storage.{name}" for name in private]
                else:
                    named = [alias.name for alias in node.names]
                misuses += [
                    f"{path.relative_to(ROOT.parent)}:{node.lineno}: {name}"
                    for name in named
                    if name.startswith("qscheme.storage.")
                ]
    assert not misuses, "import these through qscheme.storage's __all__:\n" + "\n".join(misuses)


def test_every_public_name_resolves_to_its_module() -> None:
    for name in qscheme.storage.__all__:
        value = getattr(qscheme.storage, name)
        module = getattr(value, "__module__", None)
        if module is not None and module.startswith("qscheme.storage."):
            assert getattr(sys.modules[module], name) is value
    with pytest.raises(AttributeError, match="no_such_name"):
        qscheme.storage.no_such_name  # noqa: B018


@pytest.mark.subprocess
def test_importing_storage_imports_no_torch() -> None:
    """The package loads its names on first use: the command line's ``Terminated`` stays torch-free."""
    code = (
        "import sys\n"
        "import qscheme.storage\n"
        "from qscheme.storage import Terminated, read_json, Progress\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
