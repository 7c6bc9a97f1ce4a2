#!/usr/bin/env bash
# Install, then run every check CI runs: ruff, mypy, the wheel install check, the producers'
# side venvs (nvidia-modelopt, and vLLM's Python helpers for the Marlin layouts) used as test
# oracles, and the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
export TRITON_INTERPRET=1 TRITON_DEFAULT_FP_FUSION=1
echo "== ruff"
ruff check qscheme plugins tests benchmarks
ruff format --check qscheme plugins tests benchmarks
echo "== mypy"
mypy qscheme plugins
echo "== wheel"
bash scripts/check-wheel.sh
echo "== modelopt oracle"
bash scripts/install-modelopt-oracle.sh
export QSCHEME_MODELOPT_PYTHON="$PWD/.venv-modelopt/bin/python"
echo "== vllm oracle"
bash scripts/install-vllm-oracle.sh
export QSCHEME_VLLM_PYTHON="$PWD/.venv-vllm/bin/python"
echo "== llmcompressor oracle"; bash scripts/install-llmcompressor-oracle.sh
export QSCHEME_LLMCOMPRESSOR_PYTHON="$PWD/.venv-llmcompressor/bin/python"
echo "== pytest"
python -m pytest -p no:cacheprovider "$@"
