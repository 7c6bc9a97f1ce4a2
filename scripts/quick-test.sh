#!/usr/bin/env bash
# The quick inner loop: the test suite less the tests marked slow, i.e. those that start processes
# (the CLI, fresh interpreters, torch.distributed ranks, the producers' oracle venvs) or run Triton
# kernels in the interpreter for seconds (tests/conftest.py, docs/testing.md). Under 3 minutes on
# 2 cores. A test that starts a process without being marked fails here. It runs no ruff, mypy,
# wheel check or oracle; `bash scripts/test.sh` runs everything. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export TRITON_INTERPRET=1 TRITON_DEFAULT_FP_FUSION=1 QSCHEME_CHECK_MARKS=1
python -m pytest -p no:cacheprovider -m "not slow" "$@"
