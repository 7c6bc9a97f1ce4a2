"""The wheel ships the whole tree, and the built-in plugins have one list.

``qscheme.plugins.manager.BUILTIN_PLUGINS`` is the source of the built-in plugin list (a checkout
that is not installed loads it directly); pyproject.toml's ``[project.entry-points.qscheme]``
declares the same table for installs. These tests check that the table, the installed
distribution's entry points and a freshly built wheel's all equal it, and that the wheel holds
every module and descriptor of the tree (setup.py finds the packages: none is listed by hand).
scripts/check-wheel.sh goes further: it installs the wheel and runs qscheme from it.
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
import tomllib

from qscheme.plugins.manager import BUILTIN_DISTRIBUTION, BUILTIN_PLUGINS, ENTRY_POINT_GROUP

ROOT = Path(__file__).resolve().parent.parent
INSTALLED_AS = {"qscheme": "qscheme", "plugins": "qscheme_plugins", "schemes": "qscheme_schemes"}
SHIPPED_SUFFIXES = {"qscheme": (".py", ".typed"), "plugins": (".py",), "schemes": (".py", ".yaml")}
BUILD_FILES = ("pyproject.toml", "setup.py", "README.md")


def tree_files() -> list[str]:
    """The files of the checkout git would commit (tracked, or untracked and not ignored)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout (the wheel is built from what git would commit)")
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *BUILD_FILES, *INSTALLED_AS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    return [name for name in listed if (ROOT / name).is_file()]  # a deleted, not yet committed file is gone


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    """A wheel built (no build isolation: setuptools comes from this venv) from a copy of the tree,
    or the one ``QSCHEME_WHEEL`` names: scripts/test.sh sets it to the wheel scripts/check-wheel.sh
    built from this checkout in the same run (building one takes minutes: the C++ extensions)."""
    given = os.environ.get("QSCHEME_WHEEL")
    if given:
        assert Path(given).is_file(), f"QSCHEME_WHEEL={given!r} is not a file; unset it to build a wheel here"
        return zipfile.ZipFile(given)
    folder = tmp_path_factory.mktemp("wheel")
    source = folder / "src"
    for name in tree_files():
        target = source / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / name, target)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    done = subprocess.run(
        [*pip_wheel, "-w", str(folder / "dist"), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = (folder / "dist").glob("qscheme-*.whl")
    return zipfile.ZipFile(built)


@pytest.mark.subprocess
def test_wheel_holds_every_module_and_descriptor_of_the_tree(wheel: zipfile.ZipFile) -> None:
    expected = set()
    for name in tree_files():
        folder, _, rest = name.partition("/")
        if folder in INSTALLED_AS and rest and name.endswith(SHIPPED_SUFFIXES[folder]):
            expected.add(f"{INSTALLED_AS[folder]}/{rest}")
    shipped = {name for name in wheel.namelist() if not name.split("/")[0].endswith(".dist-info")}
    # the C extension setup.py builds from qscheme/csrc (optional: absent without a C compiler)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    compiled = {name for name in shipped if name.endswith(suffix)}
    built = {f"qscheme/_{name}{suffix}" for name in ("blocks", "cpu_gemv", "tile_gemm", "int8_gemm")}
    assert compiled <= built, f"compiled modules nobody builds: {sorted(compiled)}"
    expected |= compiled
    csrc = (".c", ".cpp", ".h")
    expected |= {name for name in tree_files() if name.startswith("qscheme/csrc/") and name.endswith(csrc)}
    for must in ("qscheme/writing/quantize.py", "qscheme/parallel/rules.py", "qscheme/transformers/__init__.py"):
        assert must in expected, f"{must} is not in the tree any more; update this test"
    assert sorted(expected - shipped) == [], "files of the tree missing from the wheel"
    assert sorted(shipped - expected) == [], "files in the wheel that the tree does not have (stale build?)"


@pytest.mark.subprocess
def test_wheel_entry_points_are_the_builtin_plugins(wheel: zipfile.ZipFile) -> None:
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    parser = configparser.ConfigParser()
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keep names' case
    parser.read_string(wheel.read(name).decode())
    assert dict(parser[ENTRY_POINT_GROUP]) == BUILTIN_PLUGINS
    assert dict(parser["console_scripts"]) == {"qscheme": "qscheme.cli.main:main"}


def test_pyproject_and_installed_entry_points_are_the_builtin_plugins() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert project["project"]["entry-points"][ENTRY_POINT_GROUP] == BUILTIN_PLUGINS
    try:
        distribution = metadata.distribution(BUILTIN_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        pytest.skip("qscheme is not installed (a bare checkout loads BUILTIN_PLUGINS directly)")
    installed = {ep.name: ep.value for ep in distribution.entry_points if ep.group == ENTRY_POINT_GROUP}
    assert installed == BUILTIN_PLUGINS, "the installed metadata is stale: reinstall (scripts/install.sh)"


def test_every_builtin_plugin_module_is_in_plugins_folder() -> None:
    for name, module in BUILTIN_PLUGINS.items():
        package, _, rest = module.partition(".")
        assert package == "qscheme_plugins", f"built-in plugin {name!r}: {module} is not under qscheme_plugins"
        assert (ROOT / "plugins" / f"{rest.replace('.', '/')}.py").is_file(), f"built-in plugin {name!r}: no {module}"
