"""vLLM's CPU engine: qscheme's plugin beside vLLM's own compressed-tensors methods and the dense model.

    python benchmarks/vllm_cpu.py [--hidden 1024] [--intermediate 2816] [--layers 2] [--tokens 32]
                                  [--repeats 5] [--dtype bfloat16] [--scheme NAME ...] [--plugin-only NAME ...]
                                  [--folder DIR] [--markdown out.md]

Needs vLLM's CPU build in the side venv ``bash scripts/install-vllm-cpu.sh`` prints (its python in
``QSCHEME_VLLM_CPU_PYTHON``, or found by running the script); this script itself runs in qscheme's
own environment (transformers, to write the model).

Builds a Llama with seeded random weights (hidden ``--hidden``, ``--layers`` layers, heads of 64,
a quarter as many KV heads, a vocabulary of 2048 so that the linear layers dominate), saves it in
bf16 and quantizes it with ``qscheme quantize`` (``quantize_checkpoint``, round to nearest,
``lm_head`` left dense) into each ``--scheme`` (default: the compressed-tensors schemes vLLM's CPU
build runs with its own kernels: W4A16, W8A8 int8, FP8_DYNAMIC, FP8_BLOCK; NVFP4A16 is also
listed to show whether vLLM runs it). Every checkpoint is then served by vLLM's CPU engine
(tests/vllm_cpu_run.py, in one subprocess, eager, ``--dtype``) twice: through the plugin
(``quantization="qscheme"``) and through vLLM's own compressed-tensors method; the dense model
runs twice, first and last in each round (drift from other jobs). The engines' output goes to
DIR/engines.log.

Per engine: one greedy generation of ``--tokens`` tokens after an 8-token prompt, untimed, then
``--repeats`` timed ones; the time per output token includes the prompt's prefill (one request,
batch 1). All engines are started first and held together (1 GB of KV cache each); the timed
calls then go round the engines, one each per round, so that every round's engines share the
machine's load of that moment. Reported: the fastest and slowest repeat, the ratio of the fastest to the dense model's
fastest (the faster of its two runs) and the plugin's ratio to vLLM's own method, the kernels the
plugin's layers run (qscheme's resolver) and the tokens: the index of the first token where the
plugin and vLLM's method (or the dense model) part, "=" where all agree. A random tiny model's
logits are close together, so bf16 rounding that differs between two implementations may pick
another token after a few steps; both are then right. ``uptime``'s load is printed: on a shared
machine other jobs slow every engine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RUNNER = REPO / "tests" / "vllm_cpu_run.py"
PROMPT = [1, 306, 1966, 304, 1207, 263, 1107, 45]
DEFAULT_SCHEMES = (
    "compressed-tensors/W4A16",
    "compressed-tensors/W8A8",
    "compressed-tensors/FP8_DYNAMIC",
    "compressed-tensors/FP8_BLOCK",
    "compressed-tensors/NVFP4A16",
)


def vllm_cpu_python() -> str:
    """The vllm-cpu venv's python: QSCHEME_VLLM_CPU_PYTHON, or what scripts/install-vllm-cpu.sh prints."""
    found = os.environ.get("QSCHEME_VLLM_CPU_PYTHON")
    if found:
        return found
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "install-vllm-cpu.sh")], capture_output=True, text=True, check=True
    )
    return str(Path(done.stdout.strip().splitlines()[-1]) / "bin" / "python")


def build_source(folder: Path, hidden: int, intermediate: int, layers: int) -> int:
    """A seeded random bf16 Llama in ``folder``; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = hidden // 64
    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(folder))
    return sum(p.numel() for p in model.parameters())


def _uptime() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def first_difference(a: list[list[int]], b: list[list[int]]) -> str:
    """The index of the first token where two generations part ("=" when equal)."""
    for x, y in zip(a, b, strict=True):
        for i, (p, q) in enumerate(zip(x, y, strict=True)):
            if p != q:
                return str(i)
    return "="


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    parser.add_argument("--scheme", action="append", help="a qscheme catalog name (repeatable)")
    parser.add_argument(
        "--plugin-only",
        action="append",
        default=[],
        metavar="SCHEME",
        help="run this scheme through the plugin only (vLLM's own FP8_DYNAMIC runs torch's emulated FP8 "
        "matmul on a CPU: seconds per token)",
    )
    parser.add_argument("--folder", type=Path, help="keep the checkpoints here (reused when present)")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    schemes = args.scheme or list(DEFAULT_SCHEMES)
    python = vllm_cpu_python()

    from qscheme.writing.quantize import quantize_checkpoint

    work = args.folder or Path(tempfile.mkdtemp(prefix="qscheme-vllm-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    source = work / "dense"
    if not (source / "config.json").exists():
        count = build_source(source, args.hidden, args.intermediate, args.layers)
        print(f"dense bf16 Llama: {count / 1e6:.1f}M parameters in {source}")
    runs: list[dict[str, Any]] = [{"name": "dense", "model": str(source), "quantization": None}]
    for scheme in schemes:
        folder = work / scheme.replace("/", "__")
        if not (folder / "config.json").exists():
            start = time.perf_counter()
            quantize_checkpoint(source, folder, scheme, progress=False)
            print(f"{scheme}: quantized in {time.perf_counter() - start:.1f} s")
        runs.append({"name": f"{scheme} qscheme", "model": str(folder), "quantization": "qscheme"})
        if scheme not in args.plugin_only:
            runs.append({"name": f"{scheme} vLLM", "model": str(folder), "quantization": None})
    runs.append({"name": "dense again", "model": str(source), "quantization": None})
    for run in runs:
        run.update(dtype=args.dtype, repeats=args.repeats)
    spec = work / "runs.json"
    out = work / "results.json"
    # every engine held at once, the timed calls in turns: same-run ratios on a machine whose load moves
    spec.write_text(json.dumps({"prompts": [PROMPT], "max_tokens": args.tokens, "runs": runs, "interleave": True}))
    env = {key: value for key, value in os.environ.items() if not key.startswith("TRITON_")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    print(f"load before: {_uptime()}; the engines' log: {work / 'engines.log'}")
    with open(work / "engines.log", "w") as log:
        done = subprocess.run([python, str(RUNNER), str(spec), str(out)], env=env, stdout=log, stderr=log)
    print(f"load after: {_uptime()}")
    if not out.exists():
        print((work / "engines.log").read_text()[-4000:], file=sys.stderr)
        return 1
    if done.returncode != 0:
        print(f"the engines' process exited with {done.returncode}: the runs it finished are shown", file=sys.stderr)
    results: dict[str, Any] = json.loads(out.read_text())
    table = report(results, schemes, args)
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n")
    return 0


def report(results: dict[str, Any], schemes: list[str], args: argparse.Namespace) -> str:
    """The markdown table of the engines' times per output token, ratios and token agreement."""
    dense_runs = [results[name] for name in ("dense", "dense again") if "error" not in results.get(name, {"error": 1})]
    dense = min(min(r["s_per_token_runs"]) for r in dense_runs) if dense_runs else float("nan")
    dense_tokens = dense_runs[0]["tokens"] if dense_runs else None
    lines = [
        f"vLLM CPU engine, {args.dtype}, Llama hidden {args.hidden} / intermediate {args.intermediate} / "
        f"{args.layers} layers (random weights), 1 request, {args.tokens} output tokens after 8 prompt tokens, "
        f"{args.repeats} timed repeats; ms per output token (fastest..slowest repeat), ratio = fastest / dense "
        f"bf16's fastest ({dense * 1e3:.2f} ms); load {_uptime()}",
        "",
        "| scheme | engine | kernels | ms/token | x dense | qscheme / vLLM | first differing token vs vLLM, vs dense |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("dense", "dense again"):
        r = results.get(name, {})
        if "error" in r:
            lines.append(f"| dense bf16 | {name} | - | error: {r['error'][:120]} | | | |")
        elif r:
            times = r["s_per_token_runs"]
            lines.append(
                f"| dense {args.dtype} | vLLM ({name}) | - | {min(times) * 1e3:.2f}..{max(times) * 1e3:.2f} | "
                f"{min(times) / dense:.2f} | | |"
            )
    for scheme in schemes:
        ours, theirs = results.get(f"{scheme} qscheme", {}), results.get(f"{scheme} vLLM", {})
        for label, r in (("qscheme plugin", ours), ("vLLM's own", theirs)):
            if not r:
                continue  # not run (--plugin-only) or not reached
            if "error" in r:
                lines.append(f"| {scheme} | {label} | - | refused: {r['error'][:160]} | | | |")
                continue
            times = r["s_per_token_runs"]
            kernels = sorted({e["kernel"] for e in r["layers"].values() if isinstance(e, dict) and e.get("kernel")})
            ratio = ""
            versus = ""
            if label == "qscheme plugin" and theirs and "error" not in theirs:
                ratio = f"{min(times) / min(theirs['s_per_token_runs']):.3g}"
                versus = first_difference(r["tokens"], theirs["tokens"])
            vs_dense = first_difference(r["tokens"], dense_tokens) if dense_tokens else "?"
            lines.append(
                f"| {scheme} | {label} | {', '.join(kernels) or '-'} | {min(times) * 1e3:.2f}..{max(times) * 1e3:.2f} "
                f"| {min(times) / dense:.3g} | {ratio} | {versus or '-'}, {vs_dense} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
