#!/usr/bin/env bash
# Install, then run the main job on the shipped examples: detect, resolve and run every
# quantized layer of (1) a checkpoint exported by NVIDIA ModelOpt itself (tests/fixtures) and
# (2) a small NVFP4 checkpoint in compressed-tensors form that qscheme's example generator writes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
set -x
qscheme inspect tests/fixtures/modelopt/nvfp4
qscheme resolve tests/fixtures/modelopt/nvfp4 --device sm90
qscheme run tests/fixtures/modelopt/nvfp4
rm -rf out/tiny-nvfp4  # the generator refuses to write into a folder that is not empty
python -m qscheme.examples.make_checkpoint out/tiny-nvfp4
qscheme inspect out/tiny-nvfp4
qscheme resolve out/tiny-nvfp4 --device sm100
qscheme run out/tiny-nvfp4
