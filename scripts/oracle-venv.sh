#!/usr/bin/env bash
# Build (or reuse) the side venv of one test oracle and print its directory on stdout.
#
#   bash scripts/oracle-venv.sh NAME      NAME: modelopt | vllm | llmcompressor | llamacpp | gptq | bitsandbytes
#
# Each oracle's packages are pinned, every one of them, in scripts/oracles/NAME.lock (a
# `pip freeze` of a venv that passed the tests), and installed with --no-deps: no resolver, the
# same packages on every machine. torch comes from constraints.txt (the CPU build).
#
# The venvs live outside the clone, so that a fresh clone (CI) reuses them:
#   ${QSCHEME_ORACLE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/qscheme/oracle-venvs}/NAME-KEY
# KEY hashes the lock file, constraints.txt and the Python version: changing a pin builds a new
# venv beside the old one. A venv counts only once its import check passed (a stamp file, then
# trusted without importing again); a half-built one (an interrupted run) is removed and built again. A lock file serialises
# concurrent builds of the same venv.
set -euo pipefail
cd "$(dirname "$0")/.."
name="${1:?usage: oracle-venv.sh modelopt|vllm|llmcompressor|llamacpp|gptq|bitsandbytes}"
lock="scripts/oracles/$name.lock"
case "$name" in
    modelopt) check="import modelopt.torch.quantization.qtensor, modelopt.torch.export.quant_utils" ;;
    vllm) check="import logging; logging.disable(logging.WARNING)
import vllm.model_executor.layers.quantization.utils.marlin_utils_test
import vllm.model_executor.layers.quantization.utils.marlin_utils_fp4
import vllm.model_executor.layers.quantization.utils.marlin_utils_fp8
import vllm.model_executor.kernels.linear.mixed_precision.marlin" ;;
    llmcompressor) check="from llmcompressor.entrypoints.model_free import model_free_ptq" ;;
    gptq) check='import runpy, sys; sys.argv = ["gptq_oracle.py", "--check"]; runpy.run_path("tests/gptq_oracle.py", run_name="__main__")' ;;
    bitsandbytes) check='import runpy, sys; sys.argv = ["bitsandbytes_oracle.py", "--check"]; runpy.run_path("tests/bitsandbytes_oracle.py", run_name="__main__")' ;;
    # llama-cpp-python builds llama.cpp from its sdist with the CMAKE_ARGS line of the lock (so the
    # flags are in the cache key), without llama.cpp's common library (skip-common.cmake); no pip
    # cache, whose built wheel would ignore changed flags. The check also unpacks the sdist's
    # convert_hf_to_gguf.py into "$venv/llama.cpp" (scripts/oracles/llamacpp/finish_venv.py).
    llamacpp) check='import runpy; runpy.run_path("scripts/oracles/llamacpp/finish_venv.py", run_name="__main__")'
        CMAKE_ARGS="$(sed -n 's/^# CMAKE_ARGS: //p' "$lock") -DCMAKE_PROJECT_llama.cpp_INCLUDE=$PWD/scripts/oracles/llamacpp/skip-common.cmake"
        export CMAKE_ARGS PIP_NO_CACHE_DIR=1 ;;
    *) echo "oracle-venv.sh: unknown oracle '$name' (allowed: modelopt, vllm, llmcompressor, llamacpp, gptq, bitsandbytes)" >&2; exit 2 ;;
esac
[ -f "$lock" ] || { echo "oracle-venv.sh: $lock is missing" >&2; exit 2; }
PYTHON="${PYTHON:-python3}"
pyver="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
key="$( { cat "$lock" constraints.txt; echo "python $pyver"; } | sha256sum | cut -c1-12)"
cache="${QSCHEME_ORACLE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/qscheme/oracle-venvs}"
venv="$cache/$name-py$pyver-$key"
stamp="$venv/.qscheme-oracle-ok"
mkdir -p "$cache"
exec 9>"$venv.lock"
flock 9
if [ -f "$stamp" ] && "$venv/bin/python" -c "pass" >/dev/null 2>&1; then
    echo "$name oracle: reused $venv" >&2
    echo "$venv"
    exit 0
fi
rm -rf "$venv"
start=$SECONDS
"$PYTHON" -m venv "$venv"
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$venv/bin/python" -m pip install -q -c constraints.txt torch==2.13.0 >&2
"$venv/bin/python" -m pip install -q --no-deps -c constraints.txt -r "$lock" >&2
if ! out="$("$venv/bin/python" -c "$check" 2>&1)"; then
    echo "$out" >&2
    echo "$name oracle: the import check failed in $venv" >&2
    exit 1
fi
touch "$stamp"
echo "$name oracle: built $venv in $((SECONDS - start)) s" >&2
echo "$venv"
