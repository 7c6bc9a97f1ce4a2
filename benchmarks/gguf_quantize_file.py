"""Quantizing a whole GGUF file: ``qscheme quantize`` beside llama.cpp's ``llama_model_quantize``, same file.

    QSCHEME_LLAMACPP_PYTHON=... python benchmarks/gguf_quantize_file.py [--types Q4_0,Q8_0,Q4_K,Q6_K]
        [--layers 2] [--hidden 2048] [--threads N]

Writes a Llama-shaped float32 GGUF (random normal weights, ``--layers`` blocks of ``--hidden``
features; written with the ``gguf`` package), then for each type quantizes it with
``qscheme.writing.gguf_quantize.quantize_gguf`` (torch on ``--threads`` threads) and with
llama.cpp's ``llama_model_quantize`` (``--pure``, no importance matrix, one thread, the oracle's
baseline build: no AVX, no FMA; timed inside its process), checks that every tensor of the two
outputs has the same bytes, and prints both times, the weights per second and the ratio
(qscheme's time over llama.cpp's). Needs the llama.cpp oracle venv (``bash scripts/oracle-venv.sh
llamacpp``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

FTYPES = {"Q4_K": "Q4_K_S", "Q5_K": "Q5_K_S", "Q3_K": "Q3_K_S"}  # llama.cpp's file type of a pure file


def write_float_file(path: Path, layers: int, hidden: int) -> int:
    import gguf

    rng = np.random.default_rng(0)
    intermediate = int(hidden * 2.75) // 256 * 256
    heads = hidden // 64
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_layer_norm_rms_eps(1e-5)
    count = 0
    shapes = {
        "attn_q": (hidden, hidden),
        "attn_k": (hidden, hidden),
        "attn_v": (hidden, hidden),
        "attn_output": (hidden, hidden),
        "ffn_gate": (intermediate, hidden),
        "ffn_up": (intermediate, hidden),
        "ffn_down": (hidden, intermediate),
    }
    for index in range(layers):
        writer.add_tensor(f"blk.{index}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        for name, shape in shapes.items():
            writer.add_tensor(f"blk.{index}.{name}.weight", (rng.standard_normal(shape) * 0.02).astype(np.float32))
            count += shape[0] * shape[1]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return count


def tensors_of(path: Path) -> dict[str, tuple[str, bytes]]:
    import gguf

    return {t.name: (t.tensor_type.name, np.array(t.data).tobytes()) for t in gguf.GGUFReader(str(path)).tensors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default="Q4_0,Q8_0,Q4_K,Q6_K")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    if not os.environ.get("QSCHEME_LLAMACPP_PYTHON"):
        raise SystemExit("set QSCHEME_LLAMACPP_PYTHON (bash scripts/oracle-venv.sh llamacpp prints the venv)")
    import llamacpp_oracle as oracle

    from qscheme.writing.gguf_quantize import quantize_gguf

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        source = folder / "f32.gguf"
        weights = write_float_file(source, args.layers, args.hidden)
        print(
            f"source: {weights / 1e6:.0f}M float32 weights; qscheme on {args.threads} torch thread(s), llama.cpp on 1"
        )
        print(f"{'type':6s} {'qscheme s':>10s} {'M/s':>7s} {'llama.cpp s':>12s} {'M/s':>7s} {'ratio':>6s}  bits")
        for type_name in args.types.split(","):
            ours, theirs = folder / f"ours-{type_name}.gguf", folder / f"theirs-{type_name}.gguf"
            start = time.perf_counter()
            quantize_gguf(source, ours, f"gguf/{type_name}")
            mine = time.perf_counter() - start
            other = oracle.quantize_gguf_seconds(source, theirs, FTYPES.get(type_name, type_name), pure=True)
            same = tensors_of(ours) == tensors_of(theirs)
            print(
                f"{type_name:6s} {mine:10.2f} {weights / mine / 1e6:7.1f} {other:12.2f} {weights / other / 1e6:7.1f} "
                f"{mine / other:6.2f}  {'identical' if same else 'DIFFERENT'}",
                flush=True,
            )


if __name__ == "__main__":
    main()
