#!/usr/bin/env bash
# Install the example plugins so that the tests exercise them through real pip installs:
# - qscheme-example-plugin into .venv (its kernel's priority is -10, so it changes no other
#   test's resolution unless QSCHEME_EXAMPLE_PRIORITY says otherwise);
# - qscheme-broken-plugin into build/qscheme-broken-plugin-site only, which tests put on
#   PYTHONPATH of the subprocesses that should see it (installed into .venv it would be
#   reported by every qscheme command of every other test).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=".venv/bin/pip"
[ -x "$PIP" ] || PIP="pip"
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$PIP" install -q --no-deps --no-build-isolation -c constraints.txt ./examples/qscheme-example-plugin
rm -rf build/qscheme-broken-plugin-site
"$PIP" install -q --no-deps --no-build-isolation -c constraints.txt \
    --target build/qscheme-broken-plugin-site ./examples/qscheme-broken-plugin
echo "example plugins installed: qscheme-example-plugin (.venv), qscheme-broken-plugin (build/qscheme-broken-plugin-site)"
