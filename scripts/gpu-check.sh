#!/usr/bin/env bash
# The GPU checks as one prepared run (for a lent GPU machine, e.g. the device tool), most
# wanted first, each step under its own time limit so the whole fits in under 9 minutes (one
# 10-minute command with room to start). Logs and tables go to $OUT (default ./gpu-check-out).
# The device tool copies the working tree; pass carry=["build/wheels"] for the GemLite wheel.
#
#   bash scripts/gpu-check.sh            # on a machine with CUDA, torch and triton installed
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
PYTHON=${PYTHON:-python3}

step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log, report the status
    local name=$1 seconds=$2
    shift 2
    local start=$SECONDS
    timeout "$seconds" "$@" >"$OUT/$name.log" 2>&1
    local status=$?
    echo "== $name: exit $status in $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
    tail -n 4 "$OUT/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/summary.txt"
"$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/summary.txt"
# Limits add up to 530 s, so the whole script (with nvidia-smi and the version line) stays
# under 9 minutes. First issue 16's step 1 (the Triton kernel's GPU tests: every built-in
# scheme on the GEMM and the GEMV against the reference), then ONE side-by-side run: bf16
# F.linear, tinygemm, GemLite (installed offline from build/wheels, which
# scripts/build-gemlite-wheel.sh fills on a machine with PyPI; carry build/wheels), the native
# kernels and Triton (default GEMM tile, and the opt-in GEMV) at M 1, 4, 16 on 8192x8192 and
# 16384x16384, for NVFP4 weight-only and int4 group-128 weight-only. Then the native kernels'
# and the other GPU tests, the stream diagnostic and the eager host time.
step install 30 "$PYTHON" -m pip install -q --no-deps --no-build-isolation --no-index -e .
if compgen -G "build/wheels/gemlite-*.whl" >/dev/null; then
    step gemlite-install 15 "$PYTHON" -m pip install -q --no-deps --no-index build/wheels/gemlite-*.whl
else
    echo "== gemlite-install: no build/wheels/gemlite-*.whl (run scripts/build-gemlite-wheel.sh and carry build/wheels)" | tee -a "$OUT/summary.txt"
fi
step triton-gpu-tests 150 "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu --durations=15 tests/test_triton_gpu.py
step gemm-side-by-side 200 "$PYTHON" benchmarks/gpu_gemm.py --scheme compressed-tensors/NVFP4A16 --scheme compressed-tensors/W4A16 --shape 8192x8192 --shape 16384x16384 --m 1 --m 4 --m 16 --skip reference --markdown "$OUT/gemm-side-by-side.md"
step native-tests 60 "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu --durations=10 tests/test_tinygemm.py tests/test_native_fp8.py tests/test_native_fp4.py
step gpu-tests 45 "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu --durations=10 tests/test_quantize_gpu.py tests/test_linear_gpu.py
step stream 15 "$PYTHON" benchmarks/triton_stream.py --markdown "$OUT/stream-nvfp4.md"
step host 15 "$PYTHON" benchmarks/host_overhead.py --gpu --markdown "$OUT/host-eager.md"
