"""Checkpoint writing speed and memory: ``qscheme quantize`` vs llm-compressor, ``qscheme convert`` vs a copy.

    python benchmarks/quantize_speed.py [--gb 2.2] [--shards 4] [--hidden 2048] [--dir DIR]
                                        [--keep] [--markdown FILE] [--json]

Writes an unquantized bf16 Llama-like checkpoint of at least ``--gb`` GB in ``--shards`` shards
(tests/writing_checkpoints.py; cut between layers, which model_free_ptq needs), reads every file
once so all runs find it in the page cache, then measures, each in its own subprocess:

- ``qscheme quantize SRC OUT --scheme compressed-tensors/NVFP4A16`` (the CLI);
- llm-compressor's ``model_free_ptq(SRC, OUT, scheme="NVFP4A16", ignore=["lm_head",
  "model.embed_tokens"], device="cpu")`` (tests/llmcompressor_oracle.py under
  ``QSCHEME_LLMCOMPRESSOR_PYTHON``; left out, and said so, when that is unset). The embedding
  is ignored so both write the same tensors;
- ``qscheme convert`` of qscheme's NVFP4A16 output to ``modelopt/W4A16_NVFP4``;
- ``shutil.copyfile`` of every file of that same NVFP4A16 output (what moving it costs at best).

With model_free_ptq measured, the two NVFP4A16 outputs are also compared tensor by tensor.

Time is each tool's own call (imports excluded: llm-compressor's take ~10 s); the process wall time
is shown beside it. Dirty pages are flushed (``os.sync``) before each run; the copy is a plain
``copyfile`` (in-kernel, no fsync), while qscheme fsyncs and re-reads what it wrote to verify it,
so a second copy that fsyncs each file is shown beside it for reference.
Throughput is the size of the input's safetensors files over the call's time. Peak RSS is each
subprocess's ``ru_maxrss`` (``os.wait4``), set against the issue's bound for its input: largest
shard + 3 x largest tensor + 300 MB. Targets: quantize >= 2x model_free_ptq's throughput with a
peak RSS no higher than its; convert >= 0.5x the copy's throughput, within the bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from writing_checkpoints import LlamaShape  # noqa: E402

MB = 1e6
LLMCOMPRESSOR_ENV = "QSCHEME_LLMCOMPRESSOR_PYTHON"
QSCHEME_CLI = "import sys; from qscheme.cli.main import main; sys.exit(main(sys.argv[1:]))"
COPY = """import os, shutil, sys, time
from pathlib import Path
src, dst, durable = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "fsync"
dst.mkdir()
start = time.perf_counter()
for path in sorted(src.iterdir()):
    shutil.copyfile(path, dst / path.name)
    if durable:
        fd = os.open(dst / path.name, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
print('{"seconds": %r}' % (time.perf_counter() - start))
"""
COPY_TOOL = "copy (shutil.copyfile)"
DURABLE_COPY_TOOL = "copy + fsync"


@dataclass(frozen=True)
class Run:
    """One measured subprocess."""

    step: str  # "quantize" | "convert"
    tool: str
    input_bytes: int
    seconds: float  # the tool's own call
    wall_seconds: float  # the whole process
    peak_rss_bytes: int
    bound_bytes: int  # largest shard + 3 x largest tensor + 300 MB, of the input
    identical: str = ""  # model_free_ptq: whether qscheme's output has the same tensors

    @property
    def throughput(self) -> float:
        """Input bytes per second of the call."""
        return self.input_bytes / self.seconds


def llama_shape(gigabytes: float, hidden: int) -> LlamaShape:
    """A Llama-like shape (heads of 128, intermediate ~2.75x) with enough layers for ``gigabytes``."""
    intermediate = (hidden * 11 // 4 + 127) // 128 * 128
    heads = max(2, hidden // 128)
    probe = LlamaShape(hidden=hidden, intermediate=intermediate, layers=1, heads=heads, kv_heads=max(1, heads // 4))
    vocab = max(256, hidden * 16)
    fixed = 2 * vocab * hidden * 2 + hidden * 2
    per_layer = sum(_numel(s) for n, s in probe.tensor_shapes() if ".layers." in n) * 2
    layers = max(2, -(-(int(gigabytes * 1e9) - fixed) // per_layer))
    return LlamaShape(hidden, intermediate, layers, heads, max(1, heads // 4), vocab)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def generate(folder: Path, shape: LlamaShape, shards: int) -> None:
    """Write the source checkpoint in a child process: this one stays small (see ``measure``)."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path; "
        "from writing_checkpoints import LlamaShape, write_bf16_checkpoint; "
        "write_bf16_checkpoint(Path(sys.argv[2]), LlamaShape(*map(int, sys.argv[4:])), shards=int(sys.argv[3]), "
        "straddle=False)"  # cut between layers: see shard_plan
    )
    dims = (shape.hidden, shape.intermediate, shape.layers, shape.heads, shape.kv_heads, shape.vocab)
    subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "tests"), str(folder), str(shards), *map(str, dims)], check=True
    )


def memory_bound(folder: Path) -> int:
    """Largest shard + 3 x largest tensor + 300 MB, from the safetensors headers of ``folder``."""
    largest_shard, largest_tensor = 0, 0
    for path in folder.glob("*.safetensors"):
        largest_shard = max(largest_shard, path.stat().st_size)
        with path.open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                start, end = info["data_offsets"]
                largest_tensor = max(largest_tensor, end - start)
    return largest_shard + 3 * largest_tensor + 300 * 1_000_000


def safetensors_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.glob("*.safetensors"))


def warm(folder: Path) -> None:
    """Read every file once, so each measured run finds the input in the page cache."""
    for path in folder.iterdir():
        with path.open("rb") as handle:
            while handle.read(1 << 24):
                pass


def measure(command: list[str], seconds_of: str) -> tuple[float, float, int, str]:
    """Run ``command``; (the call's seconds from its JSON output, wall seconds, peak RSS bytes, stdout).

    The peak RSS is the child's ``ru_maxrss``, which Linux carries across exec from the process it
    was forked from: this process imports no torch, so that floor stays ~20 MB.
    """
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONWARNINGS": "ignore"}
    os.sync()  # the previous step's dirty pages are not flushed during this one
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - started
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])} ... exited {process.returncode}:\n{stderr[-3000:]}")
    value = json.loads(stdout.strip().splitlines()[-1] if seconds_of == "last-line" else stdout)["seconds"]
    seconds = float(value[0] if isinstance(value, list) else value)
    peak = usage.ru_maxrss if sys.platform == "darwin" else usage.ru_maxrss * 1024
    return seconds, wall, int(peak), stdout


def run_qscheme(step: str, arguments: list[str], input_folder: Path) -> Run:
    seconds, wall, peak, _ = measure([sys.executable, "-c", QSCHEME_CLI, step, *arguments, "--json"], "whole")
    bytes_in = safetensors_bytes(input_folder)
    return Run(step, f"qscheme {step}", bytes_in, seconds, wall, peak, memory_bound(input_folder))


def run_llmcompressor(python: str, src: Path, dst: Path) -> Run:
    spec = dst.parent / "llmcompressor-spec.json"
    job = {"src": str(src), "dst": str(dst), "scheme": "NVFP4A16", "ignore": ["lm_head", "model.embed_tokens"]}
    spec.write_text(json.dumps({"jobs": [job]}))
    oracle = str(ROOT / "tests" / "llmcompressor_oracle.py")
    seconds, wall, peak, _ = measure([python, oracle, str(spec)], "last-line")
    tool = "llm-compressor model_free_ptq"
    return Run("quantize", tool, safetensors_bytes(src), seconds, wall, peak, memory_bound(src))


def run_copy(src: Path, dst: Path, durable: bool = False) -> Run:
    """The files copied; ``durable``: each also fsynced, as qscheme's writer does before the rename."""
    command = [sys.executable, "-c", COPY, str(src), str(dst), "fsync" if durable else "plain"]
    seconds, wall, peak, _ = measure(command, "whole")
    tool = DURABLE_COPY_TOOL if durable else COPY_TOOL
    return Run("convert", tool, safetensors_bytes(src), seconds, wall, peak, memory_bound(src))


COMPARE = """import json, sys
from pathlib import Path
import torch
from safetensors import safe_open
def tensors(folder):
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            for name in handle.keys():
                yield name, path, handle
theirs = {name: path for name, path, _ in tensors(sys.argv[2])}
count, different = 0, []
for name, path, handle in tensors(sys.argv[1]):
    a = handle.get_tensor(name)
    if name not in theirs:
        different.append(name)
        continue
    with safe_open(str(theirs.pop(name)), "pt") as other:
        b = other.get_tensor(name)
    count += 1
    same = a.dtype == b.dtype and a.shape == b.shape
    if not (same and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))):
        different.append(name)
print(json.dumps({"tensors": count, "different": different + sorted(theirs)}))
"""


def compare_outputs(ours: Path, theirs: Path) -> str:
    """Whether two checkpoint folders hold the same tensors, byte for byte (in a child process)."""
    completed = subprocess.run(
        [sys.executable, "-c", COMPARE, str(ours), str(theirs)], capture_output=True, text=True, check=True
    )
    result = json.loads(completed.stdout)
    if result["different"]:
        return f"MISSED ({len(result['different'])} differ, first {result['different'][0]})"
    return f"met ({result['tensors']} tensors)"


def benchmark(root: Path, gigabytes: float, shards: int, hidden: int, llmcompressor: str | None) -> list[Run]:
    source = root / "src"
    generate(source, llama_shape(gigabytes, hidden), shards)
    warm(source)
    runs = []
    if llmcompressor:
        runs.append(run_llmcompressor(llmcompressor, source, root / "llmcompressor-nvfp4a16"))
    nvfp4a16 = root / "qscheme-nvfp4a16"
    quantize = [str(source), str(nvfp4a16), "--scheme", "compressed-tensors/NVFP4A16"]
    runs.append(run_qscheme("quantize", quantize, source))
    if llmcompressor:
        identical = compare_outputs(nvfp4a16, root / "llmcompressor-nvfp4a16")
        runs[0] = dataclasses.replace(runs[0], identical=identical)
    warm(nvfp4a16)
    runs.append(run_copy(nvfp4a16, root / "copy"))
    runs.append(run_copy(nvfp4a16, root / "copy-fsync", durable=True))
    convert = [str(nvfp4a16), str(root / "modelopt"), "--to", "modelopt/W4A16_NVFP4"]
    runs.append(run_qscheme("convert", convert, nvfp4a16))
    return runs


def verdicts(runs: list[Run]) -> list[str]:
    """The issue's targets, each with its measured ratio and whether it is met."""
    by_tool = {run.tool: run for run in runs}
    lines = []
    quantize, oracle = by_tool["qscheme quantize"], by_tool.get("llm-compressor model_free_ptq")
    if oracle is not None:
        ratio = quantize.throughput / oracle.throughput
        lines.append(f"quantize throughput: {ratio:.2f}x model_free_ptq's (target >= 2x): {_met(ratio >= 2)}")
        rss = quantize.peak_rss_bytes / oracle.peak_rss_bytes
        lines.append(f"quantize peak RSS: {rss:.2f}x model_free_ptq's (target <= 1x): {_met(rss <= 1)}")
        if oracle.identical:
            lines.append(f"quantize output bit-identical to model_free_ptq's: {oracle.identical}")
    else:
        lines.append(f"model_free_ptq not measured: {LLMCOMPRESSOR_ENV} is not set")
    convert, copy = by_tool["qscheme convert"], by_tool[COPY_TOOL]
    ratio = convert.throughput / copy.throughput
    lines.append(f"convert throughput: {ratio:.2f}x the copy's (target >= 0.5x): {_met(ratio >= 0.5)}")
    durable = by_tool.get(DURABLE_COPY_TOOL)
    if durable is not None:  # qscheme fsyncs before the rename; a plain copy leaves data in the page cache
        ratio = convert.throughput / durable.throughput
        lines.append(f"convert throughput: {ratio:.2f}x a copy that also fsyncs each file (for reference)")
    for run in (quantize, convert):
        within = run.peak_rss_bytes <= run.bound_bytes
        peak, bound = run.peak_rss_bytes / MB, run.bound_bytes / MB
        lines.append(f"{run.tool} peak RSS {peak:.0f} MB vs bound {bound:.0f} MB: {_met(within)}")
    return lines


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def markdown(runs: list[Run], shape: LlamaShape, shards: int) -> str:
    source = next(run for run in runs if run.step == "quantize")
    lines = [
        f"bf16 Llama-like checkpoint: {source.input_bytes / 1e9:.3f} GB in {shards} shards "
        f"(hidden {shape.hidden}, intermediate {shape.intermediate}, {shape.layers} layers, vocab {shape.vocab}); "
        f"{os.cpu_count()} CPU cores.",
        "",
        "| step | tool | input MB | call s | process s | MB/s | peak RSS MB | RSS bound MB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        lines.append(
            f"| {run.step} | {run.tool} | {run.input_bytes / MB:.1f} | {run.seconds:.3f} | {run.wall_seconds:.3f} | "
            f"{run.throughput / MB:.1f} | {run.peak_rss_bytes / MB:.0f} | {run.bound_bytes / MB:.0f} |"
        )
    lines += ["", *(f"- {line}" for line in verdicts(runs))]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.2, help="source checkpoint size in GB (default 2.2)")
    parser.add_argument("--shards", type=int, default=4, help="source shards (default 4)")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size of the generated model (default 2048)")
    parser.add_argument("--dir", type=Path, help="work folder (default: a temporary one, removed after)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    parser.add_argument("--json", action="store_true", help="print the runs as JSON instead of the table")
    args = parser.parse_args(argv)
    if args.shards < 3 and args.gb >= 2:
        parser.error("the issue's benchmark needs 3 or more shards")
    root = Path(tempfile.mkdtemp(prefix="qscheme-quantize-speed-", dir=args.dir))
    try:
        shape = llama_shape(args.gb, args.hidden)
        runs = benchmark(root, args.gb, args.shards, args.hidden, os.environ.get(LLMCOMPRESSOR_ENV))
        table = markdown(runs, shape, args.shards)
        if args.markdown:
            args.markdown.write_text(table, encoding="utf-8")
        if args.json:
            print(json.dumps([asdict(run) | {"throughput": run.throughput} for run in runs], indent=1))
        else:
            print(table, end="")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"kept {root}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
