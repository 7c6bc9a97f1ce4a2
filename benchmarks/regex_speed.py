"""Speed of ``re:`` targets and ignores: hundreds of patterns against thousands of module names.

    python benchmarks/regex_speed.py [--layers 94] [--experts 32] [--patterns 400]
    python benchmarks/regex_speed.py --hostile

Writes a compressed-tensors config.json whose ignore list holds ``--patterns`` ``re:`` entries
(one per layer and projection, the way llm-compressor writes per-layer exclusions, plus
near-misses that only fail late) and whose groups target the projections by regex, then times
1. reading the config (every pattern parsed, checked for catastrophic backtracking and compiled),
2. ``detect`` over a MoE-shaped model: ``--layers`` x (4 attention + ``--experts`` x 3 expert
   projections) quantized modules, each matched against every ignore entry and target.
Only headers are faked (TensorInfo entries): no tensor data is written or read.
``--hostile`` instead times the worst accepted patterns (``MAX_BACKTRACKING_REPEATS`` repeats
that give characters back, failing at the end) against names of ``MAX_NAME_LENGTH`` characters,
the longest detection reads.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from qscheme.catalog import load_catalog
from qscheme.checkpoint.config import read_producer_config
from qscheme.checkpoint.detect import detect
from qscheme.checkpoint.patterns import MAX_BACKTRACKING_REPEATS, MAX_NAME_LENGTH, compile_pattern
from qscheme.storage import TensorInfo

NVFP4 = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERT = ("gate_proj", "up_proj", "down_proj")


def module_names(layers: int, experts: int) -> list[str]:
    names = []
    for layer in range(layers):
        names += [f"model.layers.{layer}.self_attn.{proj}" for proj in ATTENTION]
        names += [f"model.layers.{layer}.mlp.experts.{e}.{proj}" for e in range(experts) for proj in EXPERT]
    return names


def tensors(names: list[str]) -> dict[str, TensorInfo]:
    file = Path("model.safetensors")
    out: dict[str, TensorInfo] = {}
    for module in names:
        for short, dtype, shape in (
            ("weight_packed", "uint8", (64, 64)),
            ("weight_scale", "float8_e4m3fn", (64, 8)),
            ("weight_global_scale", "float32", (1,)),
        ):
            out[f"{module}.{short}"] = TensorInfo(f"{module}.{short}", dtype, shape, file)
    out["lm_head.weight"] = TensorInfo("lm_head.weight", "bfloat16", (512, 128), file)
    return out


def config(layers: int, patterns: int) -> dict[str, object]:
    """``patterns`` ignore regexes that match no quantized module, and regex targets."""
    ignore = ["re:^lm_head$"]
    layer = 0
    while len(ignore) < patterns:
        # per-layer exclusions of modules this model does not have, and patterns failing late
        ignore.append(rf"re:.*layers\.{layer}\.mlp\.shared_expert\.(gate|up|down)_proj$")
        ignore.append(rf"re:model\.layers\.{layer}\.self_attn\.[qkvo]_proj_lora$")
        ignore.append(rf"re:.*\.{layer}\..*vision.*$")
        layer = (layer + 1) % max(layers, 1)
    groups = {
        "group_0": {
            "targets": [r"re:.*self_attn\.[qkvo]_proj$", r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"],
            "weights": NVFP4,
            "format": "nvfp4-pack-quantized",
        }
    }
    quant = {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": ignore[:patterns],
    }
    return {"quantization_config": quant}


def hostile() -> None:
    names = ["model." + "_" * (MAX_NAME_LENGTH - 6), "_" * MAX_NAME_LENGTH, "a" * MAX_NAME_LENGTH]
    for piece in (".*_", "[\\w.]*_", "(?:.*_)", ".*a", "[^.]*_"):
        pattern = compile_pattern("re:" + piece * MAX_BACKTRACKING_REPEATS + "x$")
        start = time.perf_counter()
        for name in names:
            pattern.match(name)
        worst = (time.perf_counter() - start) / len(names)
        print(f"{pattern.pattern!r:24} on {MAX_NAME_LENGTH:,}-character names: {worst * 1000:7.1f} ms per name")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=94)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--patterns", type=int, default=400)
    parser.add_argument("--hostile", action="store_true", help="time the worst accepted patterns instead")
    args = parser.parse_args(argv)
    if args.hostile:
        hostile()
        return 0
    schemes = list(load_catalog())
    names = module_names(args.layers, args.experts)
    headers = tensors(names)
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(config(args.layers, args.patterns)))
        start = time.perf_counter()
        producer = read_producer_config(folder)
        read_s = time.perf_counter() - start
    start = time.perf_counter()
    detection = detect(producer, headers, schemes)
    detect_s = time.perf_counter() - start
    matches = len(names) * (args.patterns + 2)
    print(f"{args.patterns} re: ignore entries + 2 re: targets, {len(names)} quantized modules")
    print(f"read config (check + compile every pattern): {read_s * 1000:8.1f} ms")
    print(f"detect ({matches:,} module x pattern pairs):{detect_s * 1000:8.1f} ms")
    print(f"modules assigned: {len(detection.modules)}, ignored: {len(detection.ignored)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
