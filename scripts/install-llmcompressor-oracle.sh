#!/usr/bin/env bash
# A separate venv with llm-compressor (CPU), used by tests/test_writing_oracles.py and
# benchmarks/quantize_speed.py as an oracle through QSCHEME_LLMCOMPRESSOR_PYTHON: its
# model_free_ptq quantizes a whole safetensors checkpoint. Kept apart from .venv because
# llmcompressor 0.14 pins compressed-tensors 0.19 and transformers <= 5.17.
# llmcompressor goes in with --no-deps beside only what `llmcompressor.entrypoints.model_free`
# imports (its other requirements, auto-round among them, serve oneshot and are never used here).
# Quick and idempotent: when the pinned versions already import, nothing is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
LLMCOMPRESSOR_VERSION=0.14.0.1
VENV=${QSCHEME_LLMCOMPRESSOR_VENV:-.venv-llmcompressor}
# versions from the installed metadata (fast); the full import runs after an install
PRESENT="from importlib.metadata import version as v
assert v('llmcompressor') == '${LLMCOMPRESSOR_VERSION}' and v('compressed-tensors') == '0.19.0'
assert v('torch').startswith('2.13.0') and v('transformers') == '5.17.0'
v('datasets'), v('accelerate'), v('loguru')"
CHECK="from llmcompressor.entrypoints.model_free import model_free_ptq"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "$PRESENT" >/dev/null 2>&1; then
    echo "llmcompressor oracle: ${LLMCOMPRESSOR_VERSION} (already installed)"
    exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$VENV/bin/pip" install -q -c constraints.txt torch==2.13.0
"$VENV/bin/pip" install -q -c constraints.txt compressed-tensors==0.19.0 transformers==5.17.0 \
    accelerate datasets loguru pyyaml numpy requests tqdm safetensors
"$VENV/bin/pip" install -q --no-deps -c constraints.txt "llmcompressor==${LLMCOMPRESSOR_VERSION}"
"$VENV/bin/python" -c "$PRESENT" && "$VENV/bin/python" -c "$CHECK" >/dev/null 2>&1
echo "llmcompressor oracle: $("$VENV/bin/python" -c "from importlib.metadata import version; print(version('llmcompressor'))")"
