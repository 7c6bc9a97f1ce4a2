"""Dequantizing GGUF blocks: qscheme's decoder beside the ``gguf`` package's numpy, in one run.

    python benchmarks/gguf_dequantize.py [--types Q4_0,Q8_0,Q4_K,Q6_K] [--shape 4096x4096] [--repeats 5]

For each GGUF type, a [N, K] tensor of random blocks (float fields made finite) is dequantized to
float32 by ``gguf.quants.dequantize`` (numpy, one thread) and by qscheme (``qscheme.canonical
.dequantize`` on the layer's canonical weight: the C loop of ``qscheme._blocks`` over slabs of
rows on torch's threads; also with one thread, and the torch decoder with ``--torch``). Every
result is checked equal to numpy's, bit for bit, before it is timed. Timings alternate between
the peers, round after round, and each figure is the best of ``--repeats`` rounds; the ratio is
numpy's time over qscheme's (how many times faster), from the same rounds. "buffer": qscheme's
decode into a float32 buffer made once (``dequantize_rows(..., out=)``, what the reference kernel
does chunk by chunk), so without the page faults of a fresh 64 MB output that both the numpy
call and ``dequantize`` pay at every call (about 30 ms for 4096x4096 on the 2-core machine).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from qscheme.canonical import canonicalize, dequantize, dequantize_rows
from qscheme.catalog import load_scheme
from qscheme.slabs import single_threaded_caller

DEFAULT_TYPES = ("Q4_0", "Q8_0", "Q4_K", "Q6_K", "Q5_K", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4", "NVFP4")


def random_blocks(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    layout = load_scheme(f"gguf/{type_name}").weight.blocks
    assert layout is not None
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n * k // layout.elements, layout.bytes), dtype=np.uint8)
    for field in layout.fields:
        span = slice(field.offset, field.offset + field.size)
        if field.format == "fp16":
            values = (rng.standard_normal(raw.shape[0] * field.count) * 0.01).astype(np.float16)
            raw[:, span] = values.view(np.uint8).reshape(raw.shape[0], -1)
        elif field.format == "e8m0":
            raw[:, span] = rng.integers(100, 140, size=(raw.shape[0], field.size), dtype=np.uint8)
    return raw.reshape(n, -1)


def best(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    times = {name: float("inf") for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name] = min(times[name], time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default=",".join(DEFAULT_TYPES))
    parser.add_argument("--shape", default="4096x4096")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--torch", action="store_true", help="also time the torch decoder (QSCHEME_BLOCKS_TORCH=1)")
    args = parser.parse_args()

    n, k = (int(v) for v in args.shape.split("x"))
    threads = torch.get_num_threads()
    from qscheme.formats.blocks import native_decoder

    native = native_decoder()
    loops = native.isa() if native is not None else "none (torch decoder)"
    print(f"dequantize [{n}, {k}] to float32; torch threads {threads}; C loop: {loops}")
    print(
        f"{'type':8s} {'numpy ms':>9s} {'qscheme ms':>10s} {'x numpy':>8s} {'1 thread ms':>11s} {'x numpy':>8s} "
        f"{'buffer ms':>10s} {'x numpy':>8s}" + ("  torch ms  x numpy" if args.torch else "")
    )
    for type_name in args.types.split(","):
        print(measure(type_name, n, k, threads, args.repeats, args.torch), flush=True)


def measure(type_name: str, n: int, k: int, threads: int, repeats: int, with_torch: bool) -> str:
    """One line of the table: the peers' best times for one type, checked bit-identical first."""
    import gguf
    from gguf import quants

    scheme = load_scheme(f"gguf/{type_name}")
    raw = random_blocks(type_name, n, k)
    kind = gguf.GGMLQuantizationType[type_name]
    weight = canonicalize(scheme, {"weight": torch.from_numpy(raw)}, n, k)
    want = quants.dequantize(raw, kind).reshape(n, k)
    got = dequantize(weight).numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"{type_name}: not bit-identical"

    def one_thread() -> object:
        torch.set_num_threads(1)
        try:
            return dequantize(weight)
        finally:
            torch.set_num_threads(threads)

    def torch_decoder() -> object:
        os.environ["QSCHEME_BLOCKS_TORCH"] = "1"
        try:
            return dequantize(weight)
        finally:
            del os.environ["QSCHEME_BLOCKS_TORCH"]

    buffer = torch.empty(n, k)

    def into_buffer() -> object:
        with single_threaded_caller():
            return dequantize_rows(weight, 0, n, out=buffer)

    calls: dict[str, Callable[[], object]] = {
        "numpy": lambda: quants.dequantize(raw, kind),
        "qscheme": lambda: dequantize(weight),
        "one": one_thread,
        "buffer": into_buffer,
    }
    if with_torch:
        calls["torch"] = torch_decoder
    times = best(calls, repeats)
    line = (
        f"{type_name:8s} {times['numpy'] * 1e3:9.1f} {times['qscheme'] * 1e3:10.1f} "
        f"{times['numpy'] / times['qscheme']:8.2f} {times['one'] * 1e3:11.1f} {times['numpy'] / times['one']:8.2f} "
        f"{times['buffer'] * 1e3:10.1f} {times['numpy'] / times['buffer']:8.2f}"
    )
    if with_torch:
        line += f"  {times['torch'] * 1e3:8.1f} {times['numpy'] / times['torch']:7.2f}"
    return line


if __name__ == "__main__":
    main()
