#!/usr/bin/env bash
# The GPU checks as one prepared run (for a lent GPU machine, e.g. the device tool), most
# wanted first, each step under its own time limit so the whole fits in under 9 minutes (one
# 10-minute command with room to start). The summary goes to $OUT/summary.txt (default folder
# ./gpu-check-out), and the logs and tables, written to $OUT/logs, end in $OUT/gpu-check.tgz
# (the device tool returns 8 files at most).
# The device tool copies the working tree; pass carry=["build/wheels"] for the GemLite wheel.
#
#   bash scripts/gpu-check.sh            # on a machine with CUDA, torch and triton installed
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check-out}
LOGS="$OUT/logs"
mkdir -p "$LOGS"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
PYTHON=${PYTHON:-python3}
# Test processes for the test steps: each compiles its own kernels and quantizes its weights
# (CPU work) and shares the GPU; Triton's on-disk cache lets one worker reuse what another
# compiled. On the H200 machine (16 cores, 2026-12-04), 8 workers ran 886 of the 1,096 Triton
# GPU tests in 150 s.
WORKERS=${GPU_CHECK_WORKERS:-14}

step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $LOGS/NAME.log, report the status
    local name=$1 seconds=$2
    shift 2
    local start=$SECONDS
    # SIGINT first: pytest then still prints its summary (failures so far) and the benchmarks
    # have already printed their rows; KILL 15 s later if that does not end it.
    timeout -s INT -k 15 "$seconds" "$@" >"$LOGS/$name.log" 2>&1
    local status=$?
    echo "== $name: exit $status in $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
    tail -n 4 "$LOGS/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/summary.txt"
"$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/summary.txt"
lscpu | grep -E "^Model name|^CPU\(s\)|^Flags" | cut -c1-400 >>"$OUT/summary.txt"
# Limits add up to 505 s, so the whole script (with nvidia-smi, the version line and a step's
# 15 s to end after SIGINT) stays under 9 minutes: 464 s on the H200 machine on 2026-12-04. First issue 16's step 1 (the Triton kernel's GPU tests: every built-in
# scheme on the GEMM and the GEMV against the reference), then ONE side-by-side run: bf16
# F.linear, tinygemm, GemLite (installed offline from build/wheels, which
# scripts/build-gemlite-wheel.sh fills on a machine with PyPI; carry build/wheels), the native
# kernels and Triton (default GEMM tile, and the opt-in GEMV) at M 1, 4, 16 on 8192x8192 and
# 16384x16384, for NVFP4 weight-only and int4 group-128 weight-only. Then the native kernels'
# and the other GPU tests, the shipped checkpoints resolved and run on the GPU, the stream
# diagnostic and the eager host time.
# The install skips the optional CPU extensions (CC=false: each fails to compile and is left
# out, as on a machine without a compiler): the GPU steps do not use them, and building them
# costs half a minute. Without them it took 5 s on the H200 machine.
step install 20 env CC=false CXX=false "$PYTHON" -m pip install -q --no-deps --no-build-isolation --no-index -e .
if ! "$PYTHON" -c "import qscheme_plugins" 2>/dev/null; then  # no editable install: the tree on the path
    mkdir -p /tmp/qscheme-tree
    ln -sfn "$PWD/qscheme" /tmp/qscheme-tree/qscheme
    ln -sfn "$PWD/plugins" /tmp/qscheme-tree/qscheme_plugins
    ln -sfn "$PWD/schemes" /tmp/qscheme-tree/qscheme_schemes
    export PYTHONPATH="/tmp/qscheme-tree${PYTHONPATH:+:$PYTHONPATH}"
    echo "== install: failed; running from the tree through PYTHONPATH" | tee -a "$OUT/summary.txt"
fi
if compgen -G "build/wheels/gemlite-*.whl" >/dev/null; then
    step gemlite-install 10 "$PYTHON" -m pip install -q --no-deps --no-index build/wheels/gemlite-*.whl
else
    echo "== gemlite-install: no build/wheels/gemlite-*.whl (run scripts/build-gemlite-wheel.sh and carry build/wheels)" | tee -a "$OUT/summary.txt"
fi
step triton-gpu-tests 160 "$PYTHON" -m pytest -q -p no:cacheprovider -n "$WORKERS" -m gpu -rfE --durations=15 tests/test_triton_gpu.py tests/test_triton_asm_decode.py
step gemm-side-by-side 140 "$PYTHON" benchmarks/gpu_gemm.py --scheme compressed-tensors/NVFP4A16 --scheme compressed-tensors/W4A16 --shape 8192x8192 --shape 16384x16384 --m 1 --m 4 --m 16 --skip reference --markdown "$LOGS/gemm-side-by-side.md"
step native-tests 45 "$PYTHON" -m pytest -q -p no:cacheprovider -n "$WORKERS" -m gpu -rfE --durations=10 tests/test_tinygemm.py tests/test_native_fp8.py tests/test_native_fp4.py
step gpu-tests 45 "$PYTHON" -m pytest -q -p no:cacheprovider -n "$WORKERS" -m gpu -rfE --durations=10 tests/test_quantize_gpu.py tests/test_linear_gpu.py tests/test_input_checks.py
# What `qscheme resolve` says runs on this GPU, for the shipped ModelOpt checkpoints, and then
# each one run on it layer by layer against its float32 reference (`qscheme run`).
step checkpoints 60 bash -c 'for c in tests/fixtures/modelopt/*/; do "$0" -m qscheme.cli.main resolve "$c" --device cuda --m 1,16,256 && "$0" -m qscheme.cli.main run "$c" --device cuda; done' "$PYTHON"
step stream 20 "$PYTHON" benchmarks/triton_stream.py --markdown "$LOGS/stream-nvfp4.md"
step host 15 "$PYTHON" benchmarks/host_overhead.py --gpu --markdown "$LOGS/host-eager.md"
cp "$OUT/summary.txt" "$LOGS/"
tar -czf "$OUT/gpu-check.tgz" -C "$LOGS" . && rm -rf "$LOGS"
