"""Package discovery for the wheel; everything else is in pyproject.toml.

Three folders of the tree are installed under other names (``plugins/`` as ``qscheme_plugins``,
``schemes/`` as ``qscheme_schemes``), which ``[tool.setuptools.packages.find]`` cannot express, so
the packages are found here from the tree: every package under each root, and the scheme folders
(YAML data, shipped through pyproject.toml's package-data) under ``schemes/``. No list to keep by hand.
"""

from __future__ import annotations

from setuptools import find_namespace_packages, find_packages, setup

ROOTS = {"qscheme": "qscheme", "qscheme_plugins": "plugins", "qscheme_schemes": "schemes"}
DATA_ROOTS = {"qscheme_schemes"}  # folders of descriptors: namespace packages, no __init__.py


def packages() -> list[str]:
    """Every package of every root, named as installed (``plugins.x`` -> ``qscheme_plugins.x``)."""
    found: list[str] = []
    for name, folder in ROOTS.items():
        if name in DATA_ROOTS:
            children = find_namespace_packages(folder, exclude=["*__pycache__*"])
            children = [c for c in children if all(part.isidentifier() for part in c.split("."))]
        else:
            children = find_packages(folder)
        found += [name, *(f"{name}.{child}" for child in sorted(children))]
    return found


if __name__ == "__main__":
    setup(package_dir=ROOTS, packages=packages())
