#!/usr/bin/env bash
# A separate venv with vLLM's Python code (no CUDA needed), used by tests/test_marlin_layout.py as
# an oracle through QSCHEME_VLLM_PYTHON: tests/vllm_oracle.py runs vLLM's Marlin prepare code.
# vLLM 0.33.0 asks for torch 2.14 by metadata; its Python helpers run on the pinned CPU torch
# 2.13, so it goes in with --no-deps, beside the packages its import chain needs. xgrammar (imported
# by vllm.parser) also goes in with --no-deps: its triton dependency is 1 GB the oracle never uses.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION=0.33.0
if [ ! -x .venv-vllm/bin/python ]; then
    python3 -m venv .venv-vllm
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv-vllm/bin/pip install -q -c constraints.txt torch==2.13.0
.venv-vllm/bin/pip install -q -c constraints.txt \
    packaging psutil pyzmq urllib3 regex "transformers<5.21" requests cbor2 aiohttp openai-harmony openai \
    pillow pybase64 cachetools msgspec cloudpickle uvloop py-cpuinfo prometheus_client fastapi pydantic \
    partial-json-parser llguidance einops numpy
.venv-vllm/bin/pip install -q --no-deps -c constraints.txt "vllm==${VLLM_VERSION}" xgrammar apache-tvm-ffi
.venv-vllm/bin/python -c "
import logging; logging.disable(logging.WARNING)
import vllm.model_executor.layers.quantization.utils.marlin_utils_test
import vllm.model_executor.layers.quantization.utils.marlin_utils_fp4
import vllm.model_executor.layers.quantization.utils.marlin_utils_fp8
import vllm.model_executor.kernels.linear.mixed_precision.marlin" 2>/dev/null
echo "vllm oracle: $(.venv-vllm/bin/python -c 'import vllm; print(vllm.__version__)' 2>/dev/null)"
