"""Checkpoint loading speed and memory: qscheme.load_checkpoint vs safetensors.torch.load_file.

    python benchmarks/load_speed.py [--gb 1.0] [--dir DIR] [--keep] [--json]

Writes a Llama-shaped NVFP4 checkpoint (compressed-tensors layout, random but valid codes and
scales, sharded with an index) of at least ``--gb`` GB, then measures, each in a fresh
subprocess so that peak RSS belongs to that one load:

- ``safetensors``: ``safetensors.torch.load_file`` on every shard (memory-mapped: it reads
  no tensor data until a tensor is used);
- ``safetensors+read``: the same, then every byte read once (what any consumer pays on first
  use, and what an eager loader pays up front);
- ``qscheme``: ``qscheme.load_checkpoint(DIR)`` with its defaults (CPU, default kernel),
  which includes each kernel's ``prepare`` (the CPU reference kernel dequantizes every layer
  to float32 there);
- ``qscheme-lazy``: everything ``load_checkpoint`` does except the kernels' ``prepare`` (plan,
  headers, detection, validation of every scale, canonical tensors, kernel resolution per
  layer): what loading costs when kernels prepare on first use.

Time is wall time of the load call only (imports excluded), with the files in the page cache
(each is read once before measuring). Peak RSS is ``ru_maxrss`` of the subprocess; "over
baseline" subtracts the RSS after imports, before the load. Ratios are reported against the
total size of the safetensors files.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from llama_shapes import block_linears

HIDDEN = 4096
INTERMEDIATE = 11008
KV = 1024
GROUP = 16
SHAPES = block_linears(HIDDEN, KV, INTERMEDIATE)
LAYERS_PER_SHARD = 4


def _layer_bytes() -> int:
    return sum(n * k // 2 + n * k // GROUP + 8 for n, k in SHAPES.values()) + 2 * HIDDEN * 2


def write_checkpoint(folder: Path, gigabytes: float) -> int:
    """A valid compressed-tensors NVFP4 checkpoint of at least ``gigabytes``; returns its size."""
    import torch
    from safetensors.torch import save_file

    layers = max(1, -(-int(gigabytes * 1e9) // _layer_bytes()))
    generator = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    shards = -(-layers // LAYERS_PER_SHARD)
    # e4m3 block scales: random positive finite bytes (0x01..0x7E), as a real checkpoint stores.
    for shard in range(shards):
        name = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for index in range(shard * LAYERS_PER_SHARD, min(layers, (shard + 1) * LAYERS_PER_SHARD)):
            prefix = f"model.layers.{index}"
            for module, (n, k) in SHAPES.items():
                base = f"{prefix}.{module}"
                tensors[f"{base}.weight_packed"] = torch.randint(
                    0, 256, (n, k // 2), dtype=torch.uint8, generator=generator
                )
                scale = torch.randint(0x30, 0x60, (n, k // GROUP), dtype=torch.uint8, generator=generator)
                tensors[f"{base}.weight_scale"] = scale.view(torch.float8_e4m3fn)
                tensors[f"{base}.weight_global_scale"] = torch.tensor([2688.0 / (1 + index)], dtype=torch.float32)
                tensors[f"{base}.input_global_scale"] = torch.tensor([448.0], dtype=torch.float32)
            tensors[f"{prefix}.input_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
            tensors[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        if shard == shards - 1:
            tensors["model.norm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    total = sum((folder / f).stat().st_size for f in set(weight_map.values()))
    index_data = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_data))
    group = {
        "targets": ["Linear"],
        "format": "nvfp4-pack-quantized",
        "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True},
        "input_activations": {
            "num_bits": 4,
            "type": "float",
            "strategy": "tensor_group",
            "group_size": 16,
            "dynamic": "local",
            "symmetric": True,
        },
    }
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": layers,
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "nvfp4-pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": group},
            "ignore": ["lm_head"],
        },
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return total


def _rss_now() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _shards(folder: Path) -> list[Path]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return sorted({folder / name for name in index["weight_map"].values()})


def measure(kind: str, folder: Path) -> dict[str, float]:
    """One measurement in this (fresh) process."""
    import torch
    from safetensors.torch import load_file

    import qscheme.checkpoint  # noqa: F401  (import cost outside the timed region)
    from qscheme.checkpoint import load_checkpoint

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    shards = _shards(folder)
    baseline = _rss_now()
    loaded: list[object]
    start = time.perf_counter()
    if kind == "safetensors":
        loaded = [load_file(str(path)) for path in shards]
    elif kind == "safetensors+read":
        states = [load_file(str(path)) for path in shards]
        loaded = list(states)
        for state in states:
            for tensor in state.values():
                tensor.view(-1).view(torch.uint8).max() if tensor.numel() else None
    elif kind == "qscheme":
        loaded = [load_checkpoint(folder, progress=False)]
    elif kind == "qscheme-lazy":
        loaded = [_load_without_prepare(folder)]
    else:
        raise SystemExit(f"unknown measurement {kind}")
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    del loaded
    return {"seconds": seconds, "peak_rss": peak, "baseline_rss": baseline}


def _load_without_prepare(folder: Path) -> object:
    from qscheme.checkpoint.load import load_canonical
    from qscheme.checkpoint.plan import plan_checkpoint
    from qscheme.kernels.registry import resolve_layer
    from qscheme.modules import problem_for

    plan = plan_checkpoint(folder)
    canonical = load_canonical(plan)
    resolutions = [resolve_layer(w.scheme, problem_for(w, "bfloat16", name), "cpu") for name, w in canonical.items()]
    return canonical, resolutions


def _warm(folder: Path) -> None:
    for path in _shards(folder):
        with path.open("rb") as handle:
            while handle.read(1 << 24):
                pass


def _subprocess(kind: str, folder: Path) -> dict[str, float]:
    command = [sys.executable, __file__, "--measure", kind, "--dir", str(folder)]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    result: dict[str, float] = json.loads(output.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="checkpoint size to generate (default 1.0)")
    parser.add_argument("--dir", type=Path, default=None, help="use / write the checkpoint here")
    parser.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    parser.add_argument("--repeat", type=int, default=3, help="measurements per loader; the median is reported")
    parser.add_argument(
        "--loaders",
        default="safetensors,safetensors+read,qscheme-lazy,qscheme",
        help="comma-separated measurements to run (default: all)",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.dir)))
        return 0

    temporary = None
    folder = args.dir
    if folder is None:
        temporary = tempfile.TemporaryDirectory(prefix="qscheme-load-speed-")
        folder = Path(temporary.name)
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "model.safetensors.index.json").exists():
        started = time.perf_counter()
        write_checkpoint(folder, args.gb)
        print(f"generated {folder} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    size = sum(p.stat().st_size for p in _shards(folder))
    _warm(folder)
    results: dict[str, dict[str, float]] = {}
    for kind in args.loaders.split(","):
        runs = sorted((_subprocess(kind, folder) for _ in range(args.repeat)), key=lambda r: r["seconds"])
        results[kind] = runs[len(runs) // 2]
    summary: dict[str, object] = {"checkpoint_bytes": size, "results": results}
    for kind in ("qscheme-lazy", "qscheme"):
        if kind not in results:
            continue
        ours = results[kind]
        for base_kind in ("safetensors", "safetensors+read"):
            if base_kind in results:
                summary[f"{kind}: time / {base_kind}"] = ours["seconds"] / results[base_kind]["seconds"]
        summary[f"{kind}: peak RSS / file size"] = ours["peak_rss"] / size
        summary[f"{kind}: peak RSS over baseline / file size"] = (ours["peak_rss"] - ours["baseline_rss"]) / size
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        gib = 1024**3
        print(f"checkpoint: {size / gib:.2f} GiB NVFP4 in {len(_shards(folder))} shards (page cache warm)")
        print(f"{'loader':<18} {'time (s)':>9} {'peak RSS (GiB)':>15} {'over baseline (GiB)':>20}")
        for kind, result in results.items():
            over = (result["peak_rss"] - result["baseline_rss"]) / gib
            print(f"{kind:<18} {result['seconds']:>9.3f} {result['peak_rss'] / gib:>15.2f} {over:>20.2f}")
        for key, value in summary.items():
            if ":" in key:
                print(f"{key}: {value:.2f}x")
    if temporary is not None and not args.keep:
        temporary.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
