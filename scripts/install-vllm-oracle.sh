#!/usr/bin/env bash
# The vllm test oracle's side venv (see scripts/oracle-venv.sh: pinned in scripts/oracles/vllm.lock,
# cached outside the clone). Links it as .venv-vllm here for convenience, unless that path exists,
# and prints the line to export.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$(bash scripts/oracle-venv.sh vllm)"
[ -e .venv-vllm ] || ln -s "$venv" .venv-vllm
echo "export QSCHEME_VLLM_PYTHON=$venv/bin/python"
