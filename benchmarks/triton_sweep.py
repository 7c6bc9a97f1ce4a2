"""Time a few tile configs of the Triton GEMM at small M (NVFP4 weight-only by default, SCHEME
to change; bf16 activations), each call's weights read from memory (L2 defeated), outputs
checked against the first config's; the heuristic's tile also with the split-K reduction
fused into the GEMM (QSCHEME_TRITON_SPLIT_K=fused).

    python benchmarks/triton_sweep.py [seconds]     # on a CUDA GPU; stops starting configs after
"""

from __future__ import annotations

import functools
import os
import sys
import time

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_gemm import copies_for, graph_time, prepared_bytes

from qscheme.catalog import load_scheme
from qscheme.triton import linear as lin
from qscheme.triton.configs import TileConfig
from qscheme.triton.samples import model_scale_dtype, random_weight

DEADLINE = time.time() + float(sys.argv[1] if len(sys.argv) > 1 else 45)
scheme = load_scheme(os.environ.get("SCHEME", "compressed-tensors/NVFP4A16"))
C = TileConfig
# The heuristic's decode tile on Hopper first (weights first; outputs are checked against the
# first config's), the same tile as x W^T (the heuristic's elsewhere), then wider tiles whose
# static loop cost per weight is lower (benchmarks/triton_sass.py).
CONFIGS = [
    C(16, 64, 128, 4, 4, 4, weights_first=True),
    C(16, 64, 128, 4, 4, 4),
    C(16, 128, 128, 8, 4, 4, weights_first=True),
    C(16, 64, 256, 4, 4, 4, weights_first=True),
]
EXTRA = [
    C(16, 128, 128, 4, 8, 4, weights_first=True),
    C(16, 64, 128, 8, 4, 4, weights_first=True),
    C(16, 128, 256, 8, 4, 3, weights_first=True),
    C(16, 64, 128, 4, 4, 6, weights_first=True),
]


def label(tile: TileConfig, mode: str) -> str:
    return tile.describe() + (" fused" if mode == "fused" and tile.split_k > 1 else "")


def main() -> None:
    for n, k in ((8192, 8192), (4096, 4096)):
        weight = random_weight(scheme, n, k, scale_dtype=model_scale_dtype(scheme, torch.bfloat16))
        prepared = [lin.prepare_weight(weight, "cuda")]
        prepared += [lin.prepare_weight(weight, "cuda") for _ in range(copies_for(prepared_bytes(prepared[0])) - 1)]
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies_for(n * k * 2))]
        nbytes = prepared_bytes(prepared[0])
        for m in (16, 1):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = graph_time([functools.partial(torch.nn.functional.linear, x, w) for w in dense])
            print(f"== {n}x{k} M={m} torch bf16 {ref * 1e6:.1f} us", flush=True)
            expected = None
            tiles = CONFIGS + EXTRA if m == 16 and n == 8192 else CONFIGS
            # the heuristic's tile with the split-K reduction fused into the GEMM, then the rest
            plan = [(tiles[0], "two-pass"), (tiles[0], "fused")] + [(tile, "two-pass") for tile in tiles[1:]]
            for tile, mode in plan:
                if time.time() > DEADLINE:
                    print("deadline", flush=True)
                    break
                os.environ[lin.SPLIT_K_VARIABLE] = mode
                try:
                    y = lin.linear(prepared[0], x, config=tile).float()
                    if expected is None:
                        expected = y
                    error = float((y - expected).abs().max() / expected.abs().max())
                    t = graph_time([functools.partial(lin.linear, p, x, config=tile) for p in prepared])
                except Exception as exc:
                    print(f"{label(tile, mode):48s} FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                print(
                    f"{label(tile, mode):48s} {t * 1e6:7.1f} us {ref / t:5.2f}x {nbytes / t / 1e9:6.0f} GB/s"
                    f" err {error:.1e}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
