"""llm-compressor's ``model_free_ptq`` as an oracle for whole-checkpoint quantization.

Two halves in one file, like the other oracles:

- run as a script under the Python of ``QSCHEME_LLMCOMPRESSOR_PYTHON`` (the side venv of
  scripts/install-llmcompressor-oracle.sh; llmcompressor 0.14 pins compressed-tensors 0.19 and
  transformers <= 5.17, so it cannot share .venv)::

      python llmcompressor_oracle.py SPEC.json

  SPEC holds ``jobs``, each with ``src``, ``dst``, ``scheme`` (a compressed-tensors preset name),
  ``ignore`` (module patterns, compressed-tensors syntax) and optionally ``input_amax``
  ({module: float}). For each it calls ``model_free_ptq(src, dst, scheme=..., ignore=...,
  device="cpu")``, then prints ``{"seconds": [...]}`` (each call alone, imports excluded). Only llm-compressor and
  compressed-tensors are imported, never qscheme.

  ``model_free_ptq`` refuses presets with static activation scales (it has no data). For those
  (``input_amax`` given, FP8 / W8A8's static per-tensor input scale), it quantizes the weights
  with the preset's own weight arguments, adds each quantized module's ``input_scale`` as
  compressed-tensors computes it from an observed min/max of -amax/+amax (``calculate_qparams``,
  in the weights' dtype, shape [1], as ``initialize_qparams`` declares it), and writes the full
  preset's ``quantization_config`` with llm-compressor's own ``update_config``: what ``oneshot``
  with those activation ranges would write.

- imported by tests and the benchmark (main venv): ``oracle_python()``, ``OracleJob`` and
  ``run_model_free_ptq``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

ENV = "QSCHEME_LLMCOMPRESSOR_PYTHON"
STATIC_INPUT_PRESETS = ("FP8", "W8A8")  # per-tensor static input scales this oracle can add


def oracle_python() -> str:
    """The oracle venv's Python, or skip the calling test (CI always sets it)."""
    python = os.environ.get(ENV)
    if not python:
        import pytest

        pytest.skip(f"{ENV} is not set: run scripts/install-llmcompressor-oracle.sh and export it")
    return python


class OracleJob(NamedTuple):
    """One ``model_free_ptq`` run: SRC -> DST in a compressed-tensors preset."""

    src: Path
    dst: Path
    scheme: str
    ignore: Sequence[str] = ("lm_head",)
    input_amax: Mapping[str, float] | None = None


def run_model_free_ptq(jobs: Sequence[OracleJob], *, python: str | None = None, timeout: float = 900) -> list[float]:
    """Run the jobs in one oracle process (its imports take seconds); returns each call's seconds."""
    spec = [
        {"src": str(job.src), "dst": str(job.dst), "scheme": job.scheme, "ignore": list(job.ignore)}
        | ({"input_amax": dict(job.input_amax)} if job.input_amax is not None else {})
        for job in jobs
    ]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump({"jobs": spec}, handle)
    try:
        completed = subprocess.run(
            [python or oracle_python(), __file__, handle.name],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "TQDM_DISABLE": "1", "PYTHONWARNINGS": "ignore"},
        )
    finally:
        os.unlink(handle.name)
    if completed.returncode != 0:
        raise RuntimeError(f"model_free_ptq failed:\n{completed.stderr[-4000:]}")
    seconds: list[float] = json.loads(completed.stdout.strip().splitlines()[-1])["seconds"]
    return seconds


# ----------------------------------------------------------------------------- the oracle side


def _main(spec_path: str) -> None:  # pragma: no cover - runs in the oracle venv
    os.environ.setdefault("TQDM_DISABLE", "1")
    from loguru import logger

    logger.remove()
    from compressed_tensors.quantization import preset_name_to_scheme
    from llmcompressor.entrypoints.model_free import model_free_ptq

    seconds = []
    for job in json.loads(Path(spec_path).read_text())["jobs"]:
        src, dst, preset, ignore = job["src"], job["dst"], job["scheme"], job["ignore"]
        input_amax = job.get("input_amax")
        start = time.perf_counter()
        if input_amax is None:
            model_free_ptq(src, dst, scheme=preset, ignore=ignore, device="cpu")
        else:
            if preset not in STATIC_INPUT_PRESETS:
                raise SystemExit(f"the oracle adds static input scales for {STATIC_INPUT_PRESETS} only, not {preset}")
            full = preset_name_to_scheme(preset, ["Linear"])
            weights_only = full.model_copy(update={"input_activations": None})
            model_free_ptq(src, dst, scheme=weights_only, ignore=ignore, device="cpu")
            _add_static_input_scales(Path(dst), full, input_amax)
            _rewrite_config(Path(dst), preset, ignore)
        seconds.append(time.perf_counter() - start)
    print(json.dumps({"seconds": seconds}))


def _add_static_input_scales(dst: Path, scheme: Any, input_amax: Mapping[str, float]) -> None:  # pragma: no cover
    import torch
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors import safe_open
    from safetensors.torch import save_file

    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    added = 0
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(dst / shard), "pt") as handle:
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        for name in [n for n in tensors if n.endswith(".weight_scale")]:
            module = name[: -len(".weight_scale")]
            if module not in input_amax:
                raise SystemExit(f"no input amax for quantized module {module}")
            dtype = tensors[name].dtype
            amax = torch.tensor([float(input_amax[module])], dtype=dtype)
            scale, _ = calculate_qparams(-amax, amax, scheme.input_activations)
            tensors[f"{module}.input_scale"] = scale.to(dtype).reshape(1)
            index["weight_map"][f"{module}.input_scale"] = shard
            index["metadata"]["total_size"] += tensors[f"{module}.input_scale"].nbytes
            added += 1
        save_file(tensors, str(dst / shard))
    if added == 0:
        raise SystemExit("no quantized module found to give an input scale")
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True))


def _rewrite_config(dst: Path, preset: str, ignore: Sequence[str]) -> None:  # pragma: no cover
    import torch
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme
    from llmcompressor.entrypoints.model_free.save_utils import update_config

    config_path = dst / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("quantization_config")
    config_path.write_text(json.dumps(config))
    scheme = preset_name_to_scheme(preset, ["Linear"])
    # the format compress_module infers for a Linear with the full preset (weights-only FP8 would be naive)
    scheme.format = infer_module_format(torch.nn.Linear, scheme).value
    full = QuantizationConfig(
        config_groups={preset: scheme},
        quantization_status=QuantizationStatus.INITIALIZED,
        ignore=list(ignore),
    )
    update_config(str(dst), full)


if __name__ == "__main__":
    _main(sys.argv[1])
