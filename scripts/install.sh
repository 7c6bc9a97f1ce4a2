#!/usr/bin/env bash
# Create .venv (if absent) and install qscheme with its test tools; torch stays pinned.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install -q -c constraints.txt torch==2.13.0
pip install -q -c constraints.txt -e ".[test]"
if [ -f .ci/install-example-plugins.sh ]; then
    bash .ci/install-example-plugins.sh
fi
