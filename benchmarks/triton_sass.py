"""What the Triton GEMM's K loop executes, per target, from its SASS: no GPU needed.

    python benchmarks/triton_sass.py [--scheme NAME ...] [--targets sm80,sm90,sm100,sm120]
                                     [--baseline GIT-REV] [--markdown FILE]

For each scheme (default: NVFP4 weight-only, int4 group-128 weight-only, ModelOpt's AWQ, NVFP4
W4A4, FP8 per-token W8A8), the GEMM launch the host code makes for a decode step (M=16, bf16
inputs, the activation pre-pass's outputs where the scheme has one, the heuristic's tile for
8192x8192 on an H100-like device) is compiled for each target and its main loop read from the
cubin (``qscheme.triton.sass``): instructions per pass, warp instructions per 1024 weights
(the loop's cost per byte the kernel streams), global loads waited on inside the loop (should
be 0: everything pipelined), moves and the tensor-core instructions, registers and spills.

``--baseline REV`` compiles the same launches from a git worktree of REV in a subprocess and
prints both side by side with the ratio current / baseline (lower is better): a kernel change
is judged in one run, on one machine. Static counts are not timings; the GPU figures come from
benchmarks/gpu_gemm.py on a GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)  # must compile real kernels
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SCHEMES = (
    "compressed-tensors/NVFP4A16",
    "compressed-tensors/W4A16",
    "modelopt/W4A16_AWQ",
    "compressed-tensors/NVFP4",
    "compressed-tensors/FP8_DYNAMIC",
)
SHAPE = (8192, 8192)


def _sass_module() -> Any:
    """This tree's qscheme/triton/sass.py, loaded by path (a baseline revision may lack it)."""
    spec = importlib.util.spec_from_file_location("_qscheme_sass", ROOT / "qscheme" / "triton" / "sass.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def measure(schemes: list[str], targets: list[str]) -> list[dict[str, Any]]:
    """Compile and profile the decode GEMM of each scheme for each target (the qscheme imported
    is whichever is first on sys.path: this tree, or a baseline worktree)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from qscheme.catalog import load_scheme
    from qscheme.triton import compile_check as cc
    from qscheme.triton import configs
    from qscheme.triton import linear as qscheme_linear
    from qscheme.triton.linear import Segment, gemm_launches, prepare_weight
    from qscheme.triton.samples import random_weight

    sass = _sass_module()
    rows = []
    for name in schemes:
        scheme = load_scheme(name)
        # scales in the model's dtype where the scheme allows it, as checkpoints keep them
        names = scheme.weight.scale.tensor.dtypes
        scale_dtype = "bfloat16" if "bfloat16" in names else None
        prepared = prepare_weight(random_weight(scheme, 256, 512, scale_dtype=scale_dtype), "cpu")
        for target in targets:
            backend, arch, _ = cc.TARGETS[target]
            if hasattr(cc, "target_device"):
                device = cc.target_device(target, "H100-like")
            else:  # a baseline revision
                device = configs.DeviceFacts("H100-like", 132, cc.SHARED_MEMORY[target])
            if hasattr(qscheme_linear, "heuristic_for"):
                tile = qscheme_linear.heuristic_for(prepared, 16, *SHAPE, torch.bfloat16, device)
            else:  # a baseline revision from before heuristic_for
                extra = [prepared.scale_dtype] if hasattr(prepared, "scale_dtype") else []
                wide = qscheme_linear.wide_decode(prepared.spec, torch.bfloat16, *extra)
                tile = configs.heuristic_config(16, *SHAPE, prepared.weight_bits, 2, device, wide)
            x = torch.zeros((16, 512), dtype=torch.bfloat16)
            out = torch.empty((16, 256), dtype=torch.bfloat16)
            segment = Segment(0, 256, prepared.segments[0].static_scale)
            native = backend == "cuda" and int(arch) >= 89
            inputs, x_scale, decoded = _pre_pass_outputs(prepared, segment, x)
            more = {"decoded_input": True} if decoded else {}
            launch = gemm_launches(
                prepared, segment, inputs, x_scale, None, out, tile, torch.bfloat16, backend, native, **more
            )[0]
            signature, constants, attributes = cc._signature(launch)
            options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
            compiled = triton.compile(
                ASTSource(launch.kernel, signature, constants, attributes),
                target=GPUTarget(*cc.TARGETS[target]),
                options=options,
            )
            cubin = compiled.asm["cubin"]
            loop = sass.profile_cubin(cubin)
            registers, stack = cc._resource_usage(cubin)
            weights = tile.block_n * tile.block_k
            rows.append(
                {
                    "scheme": name,
                    "target": target,
                    "tile": tile.describe(),
                    "instructions": loop.instructions,
                    "per_1k_weights": loop.instructions * tile.num_warps * 1024 / weights,
                    "global_loads": loop.count("global_load"),
                    "moves": loop.count("move"),
                    "mma": loop.count("mma"),
                    "registers": registers,
                    "stack": stack,
                }
            )
    return rows


def _pre_pass_outputs(prepared: Any, segment: Any, x: Any) -> tuple[Any, Any, bool]:
    """What the GEMM reads for x: x itself, or the activation pre-pass's outputs (decoded values
    where the tree has that mode and the scheme allows it, else codes and scales)."""
    if not prepared.spec.A_QUANTIZED:
        return x, None, False
    from qscheme.triton import act_quant

    options = {"static_scale": segment.static_scale, "divisor": prepared.divisor, "pre_scale": prepared.pre_scale}
    if hasattr(act_quant, "decoded_dtype"):  # a baseline may lack it
        options["decoded"] = act_quant.decoded_dtype(prepared.spec, x.dtype)
    _, quantized = act_quant.quantize_launch(x, prepared.spec, **options)
    return quantized.codes, quantized.scale, bool(getattr(quantized, "decoded", False))


def _baseline(revision: str, schemes: list[str], targets: list[str]) -> list[dict[str, Any]]:
    """``measure`` run on a git worktree of ``revision``, in a subprocess."""
    with tempfile.TemporaryDirectory() as scratch:
        tree = Path(scratch) / "baseline"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), revision], check=True)
        try:
            environment = dict(os.environ, PYTHONPATH=str(tree), TRITON_CACHE_DIR=str(Path(scratch) / "cache"))
            command = [sys.executable, __file__, "--json", "--targets", ",".join(targets)]
            for name in schemes:
                command += ["--scheme", name]
            completed = subprocess.run(command, env=environment, capture_output=True, text=True, cwd=scratch)
            if completed.returncode != 0:
                raise SystemExit(f"baseline {revision} failed:\n{completed.stderr[-3000:]}")
            return list(json.loads(completed.stdout))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


def table(rows: list[dict[str, Any]], baseline: list[dict[str, Any]] | None, label: str) -> str:
    before = {(r["scheme"], r["target"]): r for r in baseline or []}
    header = (
        "| scheme | target | tile | loop instructions | warp instr. / 1K weights | global loads in loop"
        " | moves | MMA | registers |"
    )
    if baseline is not None:
        header += f" {label}: instructions | {label}: per 1K weights | {label}: global loads | ratio |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for row in rows:
        line = (
            f"| {row['scheme']} | {row['target']} | {row['tile']} | {row['instructions']} | "
            f"{row['per_1k_weights']:.0f} | {row['global_loads']} | {row['moves']} | {row['mma']} | "
            f"{row['registers']} |"
        )
        old = before.get((row["scheme"], row["target"]))
        if baseline is not None:
            if old is None:
                line += " - | - | - | - |"
            else:
                ratio = row["per_1k_weights"] / old["per_1k_weights"]
                line += f" {old['instructions']} | {old['per_1k_weights']:.0f} | {old['global_loads']} | {ratio:.2f}x |"
        lines.append(line)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", action="append", default=[])
    parser.add_argument("--targets", default="sm80,sm90,sm100,sm120")
    parser.add_argument("--baseline", help="git revision to compare with (compiled in a worktree)")
    parser.add_argument("--markdown", help="also write the table to this file")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON (used for the baseline)")
    args = parser.parse_args()
    schemes = args.scheme or list(DEFAULT_SCHEMES)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    rows = measure(schemes, targets)
    if args.json:
        print(json.dumps(rows))
        return 0
    baseline = _baseline(args.baseline, schemes, targets) if args.baseline else None
    import triton

    label = f"baseline {args.baseline}" if args.baseline else ""
    text = f"triton {triton.__version__}\n\n" + table(rows, baseline, label)  # codegen differs by version
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
