#!/usr/bin/env bash
# The llmcompressor test oracle's side venv (see scripts/oracle-venv.sh: pinned in scripts/oracles/llmcompressor.lock,
# cached outside the clone). Links it as .venv-llmcompressor here for convenience, unless that path exists,
# and prints the line to export.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$(bash scripts/oracle-venv.sh llmcompressor)"
[ -e .venv-llmcompressor ] || ln -s "$venv" .venv-llmcompressor
echo "export QSCHEME_LLMCOMPRESSOR_PYTHON=$venv/bin/python"
