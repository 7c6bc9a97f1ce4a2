#!/usr/bin/env bash
# The GPU checks as one prepared run (for a lent GPU machine, e.g. the device tool), most
# wanted first: the GPU tests of torch's native kernels (tinygemm int4, FP8 _scaled_mm, native
# FP4 where the GPU is Blackwell) against the reference kernel, every kernel side by side with
# bf16 for int4 weight-only and FP8, then the Triton kernel's NVFP4 tables, its GPU tests, the
# W4A4 table, the stream and sweep diagnostics and the wall time of eager calls, each under its
# own time limit so the whole fits in under 10 minutes. Logs and tables go to $OUT (default
# ./gpu-check-out).
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
# Limits add up to 580 s, under a 10-minute command. The native kernels' GPU tests and their
# tables come first (issue 14's open hardware questions), then the Triton kernel's.
step install 60 "$PYTHON" -m pip install -q --no-deps --no-build-isolation --no-index -e .
step native-tests 120 "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu --durations=10 tests/test_tinygemm.py tests/test_native_fp8.py tests/test_native_fp4.py
step gemm-w4a16 60 "$PYTHON" benchmarks/gpu_gemm.py --scheme compressed-tensors/W4A16 --skip reference --markdown "$OUT/gemm-w4a16.md"
step gemm-fp8 60 "$PYTHON" benchmarks/gpu_gemm.py --scheme compressed-tensors/FP8 --scheme compressed-tensors/FP8_DYNAMIC --scheme compressed-tensors/FP8_BLOCK --skip reference --shape 4096x4096 --shape 8192x8192 --markdown "$OUT/gemm-fp8.md"
step gemm-nvfp4 70 "$PYTHON" benchmarks/gpu_gemm.py --scheme compressed-tensors/NVFP4A16 --skip reference --markdown "$OUT/gemm-nvfp4.md"
step gpu-tests 120 "$PYTHON" -m pytest -q -p no:cacheprovider --durations=15 tests/test_triton_gpu.py tests/test_quantize_gpu.py tests/test_linear_gpu.py
step gemm-w4a4 30 "$PYTHON" benchmarks/gpu_gemm.py --scheme compressed-tensors/NVFP4 --skip reference --shape 8192x8192 --markdown "$OUT/gemm-w4a4.md"
step stream 20 "$PYTHON" benchmarks/triton_stream.py --markdown "$OUT/stream-nvfp4.md"
step sweep 20 "$PYTHON" benchmarks/triton_sweep.py 38
step host 20 "$PYTHON" benchmarks/host_overhead.py --gpu --markdown "$OUT/host-eager.md"
