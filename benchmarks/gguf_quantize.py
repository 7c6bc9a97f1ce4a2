"""GGUF quantization throughput: qscheme's torch quantizers vs gguf-py's numpy ones and llama.cpp's C.

    python benchmarks/gguf_quantize.py [--rows 4096] [--columns 4096] [--types Q4_K,Q6_K] [--threads 1]
                                       [--repeats 3] [--no-llamacpp]

For each type of ``qscheme.producers.gguf.quants.supported_types()`` (or ``--types``), quantizes one
random normal float32 weight [rows, columns] and prints millions of weights per second, best of
``--repeats``: qscheme (torch on ``--threads`` CPU threads), gguf-py's numpy quantizer where it has
one, and llama.cpp's single-threaded C reference through tests/llamacpp_oracle.py when
``QSCHEME_LLAMACPP_PYTHON`` is set (timed inside the oracle's process: the array transfer and the
process start are excluded). Ratios are qscheme's time over the other's (below 1: qscheme is
faster). The target for Q4_K and Q6_K is within 5x of llama.cpp's C.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from qscheme.producers.gguf.quants import quantize_blocks, supported_types  # noqa: E402


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def gguf_seconds(values: np.ndarray, type_name: str, repeats: int) -> float | None:
    try:
        from gguf import quants
        from gguf.constants import GGMLQuantizationType
    except ImportError:
        return None
    qtype = GGMLQuantizationType[type_name]
    try:
        quants.quantize(values[:1], qtype)
    except NotImplementedError:
        return None
    with np.errstate(all="ignore"):
        return best_seconds(lambda: quants.quantize(values, qtype), repeats)


def llamacpp_seconds(values: np.ndarray, type_name: str, repeats: int) -> float | None:
    """The C quantizer's own time: the oracle's call measured around, less an empty call's time."""
    if not os.environ.get("QSCHEME_LLAMACPP_PYTHON"):
        return None
    from llamacpp_oracle import ggml_quantize

    tiny = values[:1]
    overhead = best_seconds(lambda: ggml_quantize(tiny, type_name), repeats)
    return max(best_seconds(lambda: ggml_quantize(values, type_name), repeats) - overhead, 1e-9)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--columns", type=int, default=4096)
    parser.add_argument("--types", default=",".join(supported_types()))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-llamacpp", action="store_true", help="skip llama.cpp even when its oracle is set")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    weights = torch.randn(args.rows, args.columns, generator=torch.Generator().manual_seed(0))
    values = weights.numpy()
    million_weights = weights.numel() / 1e6
    print(f"weight [{args.rows}, {args.columns}] float32, torch threads {args.threads}, best of {args.repeats}")
    print(f"{'type':8} {'qscheme':>10} {'gguf-py':>10} {'llama.cpp':>10}   ratios (qscheme time / other)")
    for type_name in args.types.split(","):
        ours = best_seconds(functools.partial(quantize_blocks, weights, type_name), args.repeats)
        numpy_time = gguf_seconds(values, type_name, args.repeats)
        c_time = None if args.no_llamacpp else llamacpp_seconds(values, type_name, args.repeats)

        def rate(seconds: float | None) -> str:
            return f"{million_weights / seconds:7.2f} M/s" if seconds else f"{'-':>10}"

        ratios = [f"{name} {ours / other:.2f}x" for name, other in (("gguf-py", numpy_time), ("C", c_time)) if other]
        print(f"{type_name:8} {rate(ours)} {rate(numpy_time)} {rate(c_time)}   {', '.join(ratios)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
