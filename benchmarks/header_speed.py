"""Time to read and check a safetensors header listing many tensors.

    python benchmarks/header_speed.py [--tensors 1000000]

Writes one safetensors file of ``--tensors`` one-byte U8 tensors (named like a model's,
``model.layers.N.mlp.weight``; a million gives an 86 MB header, under safetensors' 100 MB cap),
then times ``read_file_header`` on it: the JSON read by json's C parser, every entry checked
and the tensors' coverage of the data section. Prints wall and CPU seconds (CPU time is what a
loaded machine distorts least).
"""

from __future__ import annotations

import argparse
import json
import struct
import tempfile
import time
from pathlib import Path

from qscheme.storage import read_file_header


def write_header_file(path: Path, tensors: int) -> int:
    """A safetensors file of ``tensors`` one-byte U8 tensors; returns the header's length in bytes."""
    header = {
        f"model.layers.{index}.mlp.weight": {"dtype": "U8", "shape": [1], "data_offsets": [index, index + 1]}
        for index in range(tensors)
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(tensors))
    return len(raw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model.safetensors"
        length = write_header_file(path, args.tensors)
        print(f"{args.tensors:,} tensors, header {length / 1e6:.1f} MB")
        for _ in range(args.repeats):
            wall, cpu = time.perf_counter(), time.process_time()
            header = read_file_header(path)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            print(f"read_file_header: {wall:.2f} s wall, {cpu:.2f} s CPU ({len(header.tensors):,} tensors)")
            del header


if __name__ == "__main__":
    main()
