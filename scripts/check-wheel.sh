#!/usr/bin/env bash
# Build the wheel, install it (not editable) into a fresh venv and list the schemes from it:
# proves schemes/ and plugins/ ship inside the wheel. Dependencies come from .venv via a .pth.
set -euo pipefail
cd "$(dirname "$0")/.."
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
.venv/bin/pip wheel -q --no-deps --no-build-isolation -w "$work/dist" . >/dev/null
python3 -m venv "$work/venv"
site="$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
deps="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$deps" > "$site/zz-qscheme-deps.pth"
"$work/venv/bin/pip" install -q --no-deps "$work"/dist/qscheme-*.whl
cd "$work"
"$work/venv/bin/qscheme" schemes --json > schemes.json
"$work/venv/bin/python" - "$site" <<'PY'
import json, sys
records = json.load(open("schemes.json"))
site = sys.argv[1]
builtin = [r for r in records if r["source"] == "builtin"]
assert len(builtin) >= 18, f"only {len(builtin)} built-in schemes in the wheel"
assert all(r["path"].startswith(site) for r in builtin), "schemes not loaded from the installed wheel"
import qscheme, qscheme_plugins
assert qscheme.__file__.startswith(site), qscheme.__file__
print(f"wheel ok: {len(builtin)} built-in schemes from {site}")
PY
