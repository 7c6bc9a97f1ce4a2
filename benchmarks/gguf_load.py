"""Loading a GGUF file: ``qscheme.load_checkpoint`` beside reading the file's bytes into memory.

    python benchmarks/gguf_load.py [--type Q4_K] [--layers 4] [--hidden 2048] [--repeats 3]

Writes a Llama-shaped GGUF (``--layers`` blocks of ``--hidden`` features, an intermediate size of
2.75x, every weight of ``--type`` with random but valid blocks, float32 norms; written with the
``gguf`` package) and times, alternately, best of ``--repeats``, with the file in the page cache
(read once before measuring):

- ``read``: the file's bytes read into memory (``Path.read_bytes``): the floor of any loader;
- ``qscheme``: ``qscheme.load_checkpoint(path)``: header, names, every tensor read into its layer
  (quantized weights as their raw blocks), the fp16 scales of every block checked finite, kernels
  resolved: everything but preparing kernels (done on first use).

The ratio is qscheme's time over the read's (the target: at most 1.5x).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def write_file(path: Path, type_name: str, layers: int, hidden: int, seed: int = 0) -> None:
    import gguf

    from qscheme.catalog import load_scheme

    layout = load_scheme(f"gguf/{type_name}").weight.blocks
    assert layout is not None
    rng = np.random.default_rng(seed)
    kind = gguf.GGMLQuantizationType[type_name]
    intermediate = int(hidden * 2.75) // 256 * 256
    heads = hidden // 64

    def blocks(n: int, k: int) -> np.ndarray:
        raw = rng.integers(0, 256, size=(n * k // layout.elements, layout.bytes), dtype=np.uint8)
        for field in layout.fields:
            if field.format == "fp16":
                values = (rng.standard_normal(raw.shape[0] * field.count) * 0.01).astype(np.float16)
                raw[:, field.offset : field.offset + field.size] = values.view(np.uint8).reshape(raw.shape[0], -1)
        return raw.reshape(n, -1)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads // 4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(32000)
    shapes = {
        "attn_q": (hidden, hidden),
        "attn_k": (hidden // 4, hidden),
        "attn_v": (hidden // 4, hidden),
        "attn_output": (hidden, hidden),
        "ffn_gate": (intermediate, hidden),
        "ffn_up": (intermediate, hidden),
        "ffn_down": (hidden, intermediate),
    }
    writer.add_tensor("token_embd.weight", blocks(32000, hidden), raw_dtype=kind)
    for index in range(layers):
        writer.add_tensor(f"blk.{index}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"blk.{index}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        for name, (n, k) in shapes.items():
            writer.add_tensor(f"blk.{index}.{name}.weight", blocks(n, k), raw_dtype=kind)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.add_tensor("output.weight", blocks(32000, hidden), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--type", default="Q4_K")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import qscheme

    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "model.gguf"
        write_file(path, args.type, args.layers, args.hidden)
        size = path.stat().st_size
        path.read_bytes()  # into the page cache
        times = {"read": float("inf"), "qscheme": float("inf")}
        layers = 0
        for _ in range(args.repeats):
            start = time.perf_counter()
            data = path.read_bytes()
            times["read"] = min(times["read"], time.perf_counter() - start)
            del data
            start = time.perf_counter()
            checkpoint = qscheme.load_checkpoint(path)
            times["qscheme"] = min(times["qscheme"], time.perf_counter() - start)
            layers = len(checkpoint)
            del checkpoint
        print(f"{args.type} llama-shaped GGUF: {size / 1e6:.0f} MB, {layers} quantized layers")
        print(f"read bytes:      {times['read'] * 1e3:8.1f} ms ({size / times['read'] / 1e9:.2f} GB/s)")
        print(f"load_checkpoint: {times['qscheme'] * 1e3:8.1f} ms ({size / times['qscheme'] / 1e9:.2f} GB/s)")
        print(f"ratio: {times['qscheme'] / times['read']:.2f}x the read (target <= 1.5x)")


if __name__ == "__main__":
    main()
