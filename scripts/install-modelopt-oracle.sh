#!/usr/bin/env bash
# A separate venv with nvidia-modelopt (CPU), used by tests/test_quantize_modelopt.py as an
# oracle through QSCHEME_MODELOPT_PYTHON. Kept apart from .venv: modelopt pulls its own pins.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-modelopt/bin/python ]; then
    python3 -m venv .venv-modelopt
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv-modelopt/bin/pip install -q -c constraints.txt torch==2.13.0
.venv-modelopt/bin/pip install -q -c constraints.txt nvidia-modelopt==0.47.0 transformers==5.24.0 safetensors requests numpy
.venv-modelopt/bin/python -c "import modelopt.torch.quantization.qtensor, modelopt.torch.export.quant_utils" 2>/dev/null
echo "modelopt oracle: $(.venv-modelopt/bin/python -c 'import modelopt; print(modelopt.__version__)')"
