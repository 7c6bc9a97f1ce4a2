#!/usr/bin/env bash
# Install, then run the main job on the shipped example.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
set -x
qscheme schemes
qscheme show compressed-tensors/NVFP4
