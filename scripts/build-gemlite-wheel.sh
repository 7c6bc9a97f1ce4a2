#!/usr/bin/env bash
# Build a wheel of GemLite 0.6 (pure Python plus Triton kernels) from its source distribution
# into build/wheels/, on a machine with PyPI, for a GPU machine without network:
# scripts/gpu-check.sh installs it from there (pip --no-index --no-deps) when it is present,
# and benchmarks/gpu_gemm.py then puts GemLite's A16W4 beside the other kernels. GemLite's
# declared dependencies (numpy, tqdm, triton) are left out: the GPU machine's torch and triton
# are the ones to measure with.
#
#   bash scripts/build-gemlite-wheel.sh          # then carry build/wheels to the GPU machine
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VERSION=${GEMLITE_VERSION:-0.6.*}
OUT=build/wheels
SDIST=$(mktemp -d)
trap 'rm -rf "$SDIST"' EXIT
mkdir -p "$OUT"
"$PYTHON" -m pip download -q --no-binary :all: --no-deps "gemlite==$VERSION" -d "$SDIST"
"$PYTHON" -m pip wheel -q --no-deps -w "$OUT" "$SDIST"/gemlite-*.tar.gz
ls -l "$OUT"/gemlite-*.whl
