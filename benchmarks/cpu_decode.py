"""End-to-end CPU decode speed of a Llama-shaped model: qscheme schemes against bf16 transformers.

    python benchmarks/cpu_decode.py [--threads 2] [--tokens 32] [--runs 3] [--variant NAME ...]
                                    [--folder DIR] [--markdown out.md]
    python benchmarks/cpu_decode.py --smoke     # a tiny model, 2 tokens, one process (the test's run)

Builds a Llama-shaped model of about 1.1B parameters (hidden 2048, intermediate 8192, 16 layers,
32 heads / 8 KV heads, vocab 32000, untied lm_head) with seeded random weights, saves it in bf16,
and writes it in each scheme with qscheme's own writers:

- ``compressed-tensors/NVFP4A16``, ``compressed-tensors/W4A16`` (int4, groups of 128),
  ``compressed-tensors/FP8_DYNAMIC`` and ``compressed-tensors/W8A8`` (int8 weights and per-token
  int8 inputs) with ``qscheme.quantize_checkpoint`` (round to nearest,
  ``lm_head`` left in bf16, as the CLI's default);
- ``gguf/Q4_0`` and ``gguf/Q8_0``: ``quantize_checkpoint`` to ``compressed-tensors/W4A16_G32`` /
  ``W8A16_G32`` (the codes GGUF shares), then ``qscheme.writing.gguf_export.export_gguf`` to a
  ``.gguf`` file (without a tokenizer; the token ids are given directly).

Each variant then runs in a fresh process (so its resident memory is its own): the bf16 folder
through ``AutoModelForCausalLM.from_pretrained``, the compressed-tensors folders through a model
built from the config without initialising its weights and ``qscheme.apply_to_model``, the GGUF
files through ``qscheme.transformers.from_gguf`` (which does the same with the file's config).
``torch.set_num_threads(--threads)``. Decode: a prompt of 8 fixed token ids (``--prompt-tokens N``:
N ids, the prefill's M), one prefill forward,
then ``--tokens`` greedy steps of one token each with the KV cache (argmax, no sampling, so random
weights cannot stop early at an EOS). Each run is timed (prefill and decode apart); a warm-up run
comes first and the figure is the median over ``--runs`` runs of decode tokens per second. Where
the llama.cpp oracle venv exists (``bash scripts/oracle-venv.sh llamacpp``), the same GGUF files
also run in llama-cpp-python (``n_threads`` = ``--threads``), with the same prompt, the same
greedy steps and the same timing. The files carry no tokenizer, so llama.cpp loads them with the
``tokenizer.ggml.model`` override ``none`` (its vocabulary-free type); it evaluates one token per
call (``n_batch=1``), so its prefill figure is token by token, not batched.

Reported per variant: decode tokens/s, the ratio to bf16 transformers of the same invocation (bf16
runs first and again last, to show drift from other jobs; the ratio is to the faster of the two),
prefill ms, resident memory (VmRSS) after loading and after decoding and the peak (VmHWM), and
the kernel plan of the quantized layers (``QuantLinear.plan``: the kernel per batch-size range,
as ``qscheme resolve --m`` shows it), with how many layers share it. ``uptime``'s load average
is printed beside the figures: on a shared machine other jobs slow every variant.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PROMPT = [1, 306, 4966, 304, 1207, 263, 2107, 9045]


def prompt_ids(count: int) -> list[int]:
    """The first ``count`` token ids of the prompt: PROMPT, then a fixed stride through the first
    10,000 ids (both shapes' vocabularies hold them; random weights make any ids as good as any other
    for timing)."""
    return [*PROMPT, *((1000 + 37 * i) % 10000 for i in range(max(0, count - len(PROMPT))))][:count]


FULL_SHAPE: dict[str, Any] = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
}
SMOKE_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 10000,
}


@dataclass(frozen=True)
class Variant:
    name: str
    scheme: str | None  # what quantize_checkpoint writes; None: the bf16 source itself
    gguf: str | None = None  # export the written folder to this GGUF scheme


VARIANTS = (
    Variant("bf16", None),
    Variant("NVFP4A16", "compressed-tensors/NVFP4A16"),
    Variant("W4A16", "compressed-tensors/W4A16"),
    Variant("FP8_DYNAMIC", "compressed-tensors/FP8_DYNAMIC"),
    Variant("W8A8", "compressed-tensors/W8A8"),
    Variant("Q4_0", "compressed-tensors/W4A16_G32", "gguf/Q4_0"),
    Variant("Q8_0", "compressed-tensors/W8A16_G32", "gguf/Q8_0"),
)
BY_NAME = {variant.name: variant for variant in VARIANTS}


def _config(shape: dict[str, Any]) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        **shape,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )


def build_source(folder: Path, shape: dict[str, Any]) -> int:
    """Save a seeded random bf16 Llama to ``folder``; returns its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(shape), dtype=torch.bfloat16)
    count = sum(p.numel() for p in model.parameters())
    model.save_pretrained(str(folder))
    return count


def write_variant(source: Path, work: Path, variant: Variant) -> Path:
    """Write ``variant`` from the bf16 ``source``; returns the folder or GGUF file to load."""
    import qscheme

    if variant.scheme is None:
        return source
    folder = work / variant.name
    qscheme.quantize_checkpoint(source, folder, variant.scheme, force=True, progress=False)
    if variant.gguf is None:
        return folder
    from qscheme.writing.gguf_export import export_gguf

    path = work / f"{variant.name}.gguf"
    export_gguf(folder, path, variant.gguf, without_tokenizer=True, force=True, progress=False)
    shutil.rmtree(folder)
    return path


def _memory() -> dict[str, int]:
    """VmRSS and VmHWM of this process, bytes."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def _load(variant: Variant, path: Path) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    import qscheme

    if variant.scheme is None:
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    if variant.gguf is not None:
        from qscheme.transformers import from_gguf

        return from_gguf(path, dtype=torch.bfloat16)
    config = AutoConfig.from_pretrained(str(path))
    config.quantization_config = None
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    qscheme.apply_to_model(model, path, progress=False)
    return model.eval()


def _plans(model: Any) -> list[list[object]]:
    """[[count, scheme, plan, kernel at M=1]] over the model's QuantLinear layers."""
    from qscheme.modules import QuantLinear

    counts: Counter[tuple[str, str, str]] = Counter()
    for module in model.modules():
        if isinstance(module, QuantLinear):
            counts[(module.scheme.name, module.plan.describe(), module.kernel_for_batch(1).name)] += 1
    return [[count, *key] for key, count in sorted(counts.items())]


def _decode_once(model: Any, tokens: int, prompt: list[int]) -> tuple[float, float, list[int]]:
    """(prefill seconds, decode seconds, the tokens chosen) of one greedy run: a prefill forward,
    then ``tokens`` one-token steps with the KV cache (``tokens`` + 1 tokens chosen)."""

    started = time.perf_counter()
    out = _prefill(model, prompt)
    prefilled = time.perf_counter()
    generated = _steps(model, out, tokens)
    return prefilled - started, time.perf_counter() - prefilled, generated


def _prefill(model: Any, prompt: list[int]) -> Any:
    """The prompt's forward, with the KV cache."""
    import torch

    return model(input_ids=torch.tensor([prompt]), use_cache=True)


def _steps(model: Any, out: Any, tokens: int) -> list[int]:
    """Greedy one-token steps after ``out`` (a forward's output): the ``tokens`` + 1 tokens chosen."""
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    generated = [token]
    for _ in range(tokens):
        out = model(input_ids=token, cache=out.cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        generated.append(token)
    return [int(t) for t in generated]


def _breakdown(model: Any, tokens: int, prompt: list[int]) -> dict[str, float]:
    """Milliseconds per decode token inside the quantized layers (QuantLinear), inside the other
    linear layers (nn.Linear: ``lm_head``, and every layer of the bf16 model), and the rest
    (attention, norms, embeddings, the argmax, Python), from one more greedy run whose decode
    steps run with forward hooks that time each such call (the hooks' own cost, about 1 us a
    call, falls in "rest" and "total")."""
    import torch

    from qscheme.modules import QuantLinear

    spent = {"quantized": 0.0, "linear": 0.0}
    started: dict[int, float] = {}

    def before(module: Any, inputs: Any) -> None:
        started[id(module)] = time.perf_counter()

    def timer(kind: str) -> Any:
        def after(module: Any, inputs: Any, output: Any) -> None:
            spent[kind] += time.perf_counter() - started[id(module)]

        return after

    out = _prefill(model, prompt)  # untimed
    handles = []
    for module in model.modules():
        if isinstance(module, (QuantLinear, torch.nn.Linear)):
            kind = "quantized" if isinstance(module, QuantLinear) else "linear"
            handles += [module.register_forward_pre_hook(before), module.register_forward_hook(timer(kind))]
    try:
        begun = time.perf_counter()
        _steps(model, out, tokens)
        total = time.perf_counter() - begun
    finally:
        for handle in handles:
            handle.remove()
    per_token = {kind: value * 1e3 / tokens for kind, value in spent.items()}
    per_token["total"] = total * 1e3 / tokens
    per_token["rest"] = per_token["total"] - per_token["quantized"] - per_token["linear"]
    return per_token


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Load one variant in this process, decode, and return its figures."""
    import torch

    torch.set_num_threads(int(spec["threads"]))
    variant = BY_NAME[spec["variant"]]
    before = _memory()
    started = time.perf_counter()
    model = _load(variant, Path(spec["path"]))
    load_seconds = time.perf_counter() - started
    loaded = _memory()
    runs = []
    prompt = [int(token) for token in spec["prompt"]]
    with torch.inference_mode():
        generated = _decode_once(model, int(spec["tokens"]), prompt)[2]  # warm-up: prepares every kernel state
        for _ in range(int(spec["runs"])):
            runs.append(_decode_once(model, int(spec["tokens"]), prompt))
        breakdown = _breakdown(model, int(spec["tokens"]), prompt)
    after = _memory()
    return {
        "variant": variant.name,
        "engine": "transformers" if variant.scheme is None else "qscheme",
        "threads": torch.get_num_threads(),
        "load_s": load_seconds,
        "prefill_s": statistics.median(run[0] for run in runs),
        "tokens_per_s": statistics.median(int(spec["tokens"]) / run[1] for run in runs),
        "rss_start": before["VmRSS"],
        "rss_loaded": loaded["VmRSS"],
        "rss_after": after["VmRSS"],
        "peak": after["VmHWM"],
        "plans": _plans(model),
        "generated": generated,
        "breakdown": breakdown,
    }


LLAMACPP_SIDE = r"""
import json, statistics, sys, time
import numpy as np
from llama_cpp import Llama

spec = json.loads(sys.argv[1])
def memory():
    fields = {}
    for line in open("/proc/self/status").read().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields
before = memory()
started = time.perf_counter()
# the file has no tokenizer (token ids are given): "none" is llama.cpp's vocabulary-free type
context = max(256, len(spec["prompt"]) + spec["tokens"] + 8)
model = Llama(model_path=spec["path"], n_ctx=context, n_batch=1, n_ubatch=1, n_threads=spec["threads"],
              n_threads_batch=spec["threads"], verbose=False, kv_overrides={"tokenizer.ggml.model": "none"})
vocab = model.n_vocab()
load_s = time.perf_counter() - started
loaded = memory()
def last():
    return int(np.argmax(np.ctypeslib.as_array(model._ctx.get_logits(), shape=(vocab,))))
def once():
    model.reset()
    started = time.perf_counter()
    model.eval(spec["prompt"])
    prefilled = time.perf_counter()
    generated = [last()]
    for _ in range(spec["tokens"]):
        model.eval([generated[-1]])
        generated.append(last())
    return prefilled - started, time.perf_counter() - prefilled, generated
generated = once()[2]
runs = [once() for _ in range(spec["runs"])]
after = memory()
print(json.dumps({
    "variant": spec["variant"], "engine": "llama.cpp", "threads": spec["threads"], "load_s": load_s,
    "prefill_s": statistics.median(r[0] for r in runs),
    "tokens_per_s": statistics.median(spec["tokens"] / r[1] for r in runs),
    "rss_start": before["VmRSS"], "rss_loaded": loaded["VmRSS"], "rss_after": after["VmRSS"],
    "peak": after["VmHWM"], "plans": [], "generated": generated,
}))
"""


def llamacpp_python() -> str | None:
    """The llama.cpp oracle venv's python, if that venv is built (never builds it)."""
    explicit = os.environ.get("QSCHEME_LLAMACPP_PYTHON")
    if explicit:
        return explicit if Path(explicit).exists() else None
    root = Path.home() / ".cache" / "qscheme" / "oracle-venvs"
    found = sorted(root.glob("llamacpp-*/bin/python")) if root.is_dir() else []
    return str(found[-1]) if found else None


def llamacpp_system_info(python: str) -> str:
    """llama.cpp's own line of the CPU features it was built for (``llama_print_system_info``)."""
    code = "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    return done.stdout.strip() or f"unknown ({done.stderr.strip()[-200:]})"


def _run_json(command: list[str]) -> dict[str, Any]:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{command[:3]} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_variant(variant: Variant, path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One variant's figures, from a fresh process (``--in-process``: this one; faster, but the
    memory figures then include the earlier variants')."""
    spec = {"variant": variant.name, "path": str(path), "threads": args.threads, "tokens": args.tokens}
    spec.update(runs=args.runs, prompt=prompt_ids(args.prompt_tokens))
    if args.in_process:
        return worker(spec)
    return _run_json([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)])


def run_llamacpp(python: str, variant: Variant, path: Path, args: argparse.Namespace) -> dict[str, Any]:
    spec = {"variant": variant.name, "path": str(path), "threads": args.threads, "tokens": args.tokens}
    spec.update(runs=args.runs, prompt=prompt_ids(args.prompt_tokens))
    return _run_json([python, "-c", LLAMACPP_SIDE, json.dumps(spec)])


def _mib(value: int) -> str:
    return f"{value / 2**20:.0f}"


def table(results: list[dict[str, Any]]) -> str:
    """The results as markdown: decode speed and memory, then the kernel plans."""
    base = max((r["tokens_per_s"] for r in results if r["variant"] == "bf16"), default=None)
    lines = [
        "| variant | engine | threads | decode tok/s | vs bf16 | prefill ms | load s | RSS loaded MiB "
        "| RSS after decode MiB | peak MiB | greedy tokens agreeing |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        lines.append(
            f"| {r['variant']} | {r['engine']} | {r['threads']} | {r['tokens_per_s']:.2f} | {ratio} "
            f"| {r['prefill_s'] * 1e3:.0f} | {r['load_s']:.1f} | {_mib(r['rss_loaded'])} | {_mib(r['rss_after'])} "
            f"| {_mib(r['peak'])} | {_agreement(r, results)} |"
        )
    lines += [
        "",
        "Where a decode token's time goes (one more run, its layer calls timed by forward hooks):",
        "",
        "| variant | ms per token | quantized layers | other linear layers (lm_head; all of bf16's) | the rest |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        if "breakdown" in r:
            b = r["breakdown"]
            lines.append(
                f"| {r['variant']} | {b['total']:.1f} | {b['quantized']:.1f} | {b['linear']:.1f} | {b['rest']:.1f} |"
            )
    lines += ["", "| variant | layers | scheme | plan | kernel at M=1 |", "|---|---|---|---|---|"]
    for r in results:
        for count, scheme, plan, kernel in r["plans"]:
            lines.append(f"| {r['variant']} | {count} | {scheme} | {plan} | {kernel} |")
    return "\n".join(lines)


def _uptime() -> str:
    """The 1, 5 and 15 minute load averages, as ``uptime`` prints them."""
    return ", ".join(Path("/proc/loadavg").read_text().split()[:3])


def _agreement(result: dict[str, Any], results: list[dict[str, Any]]) -> str:
    """How many leading greedy tokens agree with the reference: llama.cpp against qscheme on the
    same file, a qscheme variant against bf16 transformers."""
    if result["engine"] == "llama.cpp":
        reference = next((r for r in results if r["variant"] == result["variant"] and r["engine"] == "qscheme"), None)
    elif result["variant"] != "bf16":
        reference = next((r for r in results if r["variant"] == "bf16"), None)
    else:
        return "-"
    if reference is None:
        return "-"
    ours, theirs = result["generated"], reference["generated"]
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))
    return f"{same}/{len(ours)} ({'qscheme' if result['engine'] == 'llama.cpp' else 'bf16'})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a tiny model, 2 tokens, one run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument(
        "--prompt-tokens", type=int, default=len(PROMPT), help="prompt length: the prefill's M (default 8)"
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--variant", action="append", choices=sorted(BY_NAME), help="repeatable; default: all")
    parser.add_argument(
        "--llamacpp-python",
        help="the python of a venv with llama-cpp-python (default: $QSCHEME_LLAMACPP_PYTHON, else the oracle venv, "
        "which is built for a baseline x86-64 CPU without AVX: pass a native build for representative figures)",
    )
    parser.add_argument("--no-llamacpp", action="store_true", help="skip llama.cpp even where its venv exists")
    parser.add_argument("--folder", type=Path, help="work folder (default: a temporary one, removed)")
    parser.add_argument("--markdown", type=Path, help="also write the tables here")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    parser.add_argument(
        "--in-process", action="store_true", help="run the variants in this process (the smoke run's default)"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    if args.prompt_tokens < 1:
        parser.error(f"--prompt-tokens {args.prompt_tokens}: the prompt needs at least one token")
    if args.smoke:
        args.tokens, args.runs, args.in_process = min(args.tokens, 2), 1, True
    shape = SMOKE_SHAPE if args.smoke else FULL_SHAPE
    names = args.variant or [variant.name for variant in VARIANTS]
    if "bf16" not in names:
        names = ["bf16", *names]
    if len(names) > 1:  # bf16 again at the end: the ratios are to the faster of its two runs
        names.append("bf16")
    variants = [BY_NAME[name] for name in names]
    python = None if args.no_llamacpp else (args.llamacpp_python or llamacpp_python())
    work = args.folder or Path(tempfile.mkdtemp(prefix="qscheme-cpu-decode-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        source = work / "bf16"
        started = time.perf_counter()
        count = build_source(source, shape)
        print(f"model: Llama {shape}, {count / 1e9:.3f}B parameters, bf16 in {time.perf_counter() - started:.0f} s")
        print(f"llama.cpp: {python or 'no oracle venv (bash scripts/oracle-venv.sh llamacpp builds it)'}")
        if python is not None:
            print(f"llama.cpp build: {llamacpp_system_info(python)}")
        results = []
        for variant in variants:
            started = time.perf_counter()
            path = write_variant(source, work, variant)
            written = time.perf_counter() - started
            result = run_variant(variant, path, args)
            results.append(result)
            print(f"{variant.name}: written in {written:.0f} s, {result['tokens_per_s']:.2f} tok/s, load {_uptime()}")
            if variant.gguf is not None and python is not None:
                result = run_llamacpp(python, variant, path, args)
                results.append(result)
                print(f"{variant.name} llama.cpp: {result['tokens_per_s']:.2f} tok/s, load {_uptime()}")
            if variant.scheme is not None and args.folder is None:
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink()
    finally:
        if args.folder is None:
            shutil.rmtree(work, ignore_errors=True)
    text = table(results)
    header = (
        f"Llama-shaped {count / 1e9:.2f}B random weights, {args.threads} threads, prompt {args.prompt_tokens} tokens, "
        f"{args.tokens} greedy decode tokens, median of {args.runs} runs after a warm-up; load average {_uptime()}"
    )
    print()
    print(header)
    print()
    print(text)
    if args.markdown:
        args.markdown.write_text(header + "\n\n" + text + "\n")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
