#!/usr/bin/env bash
# The modelopt test oracle's side venv (see scripts/oracle-venv.sh: pinned in scripts/oracles/modelopt.lock,
# cached outside the clone). Links it as .venv-modelopt here for convenience, unless that path exists,
# and prints the line to export.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$(bash scripts/oracle-venv.sh modelopt)"
[ -e .venv-modelopt ] || ln -s "$venv" .venv-modelopt
echo "export QSCHEME_MODELOPT_PYTHON=$venv/bin/python"
