"""Test-wide setup. Triton reads TRITON_INTERPRET when @triton.jit decorates, i.e. at import,
so it is set here before anything imports qscheme (GPU-less machines run kernels interpreted)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
