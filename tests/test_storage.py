"""qscheme.storage: the layer that reads and writes files sits below checkpoint/, writing/ and parallel/."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from import_walk import ROOT, chains
from import_walk import closure as _closure
from import_walk import import_nodes as _import_nodes
from import_walk import imports as _imports

import qscheme.storage

STORAGE = ROOT / "storage"
# What the storage layer must never import, at module level or inside a function, directly or
# through another module: the layers that use it.
ABOVE = ("qscheme.checkpoint", "qscheme.parallel", "qscheme.writing", "qscheme.transformers")
# The packages that read and write files through storage's public names.
USERS = ("checkpoint", "writing", "parallel")


def _storage_modules() -> list[str]:
    return ["qscheme.storage"] + [f"qscheme.storage.{path.stem}" for path in sorted(STORAGE.glob("[!_]*.py"))]


def test_storage_imports_nothing_of_the_layers_above() -> None:
    start = _storage_modules()
    assert {"qscheme.storage.safetensors_reader", "qscheme.storage.shards", "qscheme.storage.json_files"} <= set(start)
    reached = _closure(start)
    above = sorted(name for name in reached if name.startswith(ABOVE))
    assert not above, "the storage layer reaches a layer above it:\n" + chains(reached, above)


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
