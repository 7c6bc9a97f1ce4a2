#!/usr/bin/env bash
# The GPU checks of the Triton kernel as one prepared run (for a lent GPU machine, e.g. the
# device tool): the GEMM benchmark for NVFP4 weight-only, the same tiles streaming their bytes
# with no work (what the tiling alone reaches), a tile sweep, the GPU tests, the GEMM benchmark
# for NVFP4 W4A4 and int4 weight-only, then the wall time of eager calls (the host's share),
# each under its own time limit so the whole fits in under 10 minutes. Logs and tables go to
# $OUT (default ./gpu-check-out).
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
# Limits add up to 580 s, under a 10-minute command. The NVFP4 table (checked against the
# reference kernel before it is timed), the stream table and the sweep come first: they answer
# whether the targets hold, and what limits the kernel, should a later step run out of time.
step install 60 "$PYTHON" -m pip install -q --no-deps --no-build-isolation --no-index -e .
step gemm-nvfp4 100 "$PYTHON" benchmarks/gpu_gemm.py --scheme compressed-tensors/NVFP4A16 --markdown "$OUT/gemm-nvfp4.md"
step stream 50 "$PYTHON" benchmarks/triton_stream.py --markdown "$OUT/stream-nvfp4.md"
step sweep 50 "$PYTHON" benchmarks/triton_sweep.py 38
step gpu-tests 210 "$PYTHON" -m pytest -q -p no:cacheprovider --durations=15 tests/test_triton_gpu.py tests/test_quantize_gpu.py tests/test_linear_gpu.py
step gemm-w4a4 50 "$PYTHON" benchmarks/gpu_gemm.py --scheme compressed-tensors/NVFP4 --markdown "$OUT/gemm-w4a4.md"
step gemm-w4a16 40 "$PYTHON" benchmarks/gpu_gemm.py --scheme compressed-tensors/W4A16 --markdown "$OUT/gemm-w4a16.md"
step host 20 "$PYTHON" benchmarks/host_overhead.py --gpu --markdown "$OUT/host-eager.md"
