"""bitsandbytes as an oracle: tiny Llama checkpoints written by transformers' own bitsandbytes
integration, bitsandbytes' own CPU dequantization of every quantized layer, and transformers' own
loader's logits.

Two halves in one file, like the other oracles:

- run as a script under the Python of ``QSCHEME_BITSANDBYTES_PYTHON`` (the side venv of
  ``scripts/oracle-venv.sh bitsandbytes``: bitsandbytes 0.50.2, whose CPU backend runs here,
  with transformers 5.24.0 and accelerate)::

      python bitsandbytes_oracle.py SPEC.json        # or --check: import what the jobs use

  SPEC holds ``jobs``; each builds a tiny LlamaForCausalLM (``model``: LlamaConfig keywords, in
  ``dtype``, seeded), saves it dense into ``dst/dense`` and loads it back through transformers
  with ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
  bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=dtype)``; that model's
  ``save_pretrained`` writes ``dst/quantized`` (the checkpoint under test). It then writes
  ``dst/reference.safetensors`` with, per quantized module, ``<module>.dequantized`` (bitsandbytes'
  own ``dequantize_4bit`` of the saved state, [N, K], in the state's dtype) and
  ``<module>.dequantized_float32`` (its CPU op ``bitsandbytes::dequantize_4bit`` with dtype
  float32, from the absmax ``dequantize_blockwise`` restores); and ``logits``: transformers' own
  loader of ``dst/quantized`` run on ``input_ids`` (also stored), in float32, on bitsandbytes'
  dequantize-then-matmul CPU path (``Linear4bit.support_avx512bf16_for_cpu`` false: the path of
  every CPU without AVX512-BF16), and ``logits_native``: the same on the path this CPU takes (with
  AVX512-BF16, bitsandbytes repacks the weight and multiplies in bfloat16). Only torch,
  transformers, safetensors and bitsandbytes are imported, never qscheme.

- imported by tests (main venv): ``oracle_python()`` and ``build_checkpoints``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ENV = "QSCHEME_BITSANDBYTES_PYTHON"


def oracle_python() -> str:
    """The oracle venv's Python, or skip the calling test (CI always sets it)."""
    import oracle_jobs  # the tests' helper; the oracle side (run as a script in the venv, with no tests/ on
    # its path: the venv's import check on a cold build) needs none

    return oracle_jobs.oracle_python(ENV, "bitsandbytes")


def build_checkpoints(jobs: Sequence[Mapping[str, Any]], *, python: str | None = None, timeout: float = 600) -> None:
    """Write each job's folders (see the module docstring) in one oracle process."""
    import oracle_jobs

    oracle_jobs.run_jobs(
        __file__, jobs, python=python or oracle_python(), label="bitsandbytes", timeout=timeout, extra_env=None
    )


# ----------------------------------------------------------------------------- the oracle side


def _dequantize_job(job: Mapping[str, Any]) -> None:
    """bitsandbytes' own ``dequantize_4bit`` (float32) of each layer of ``tensors`` (a safetensors file of
    bitsandbytes-layout layers named ``<layer>.weight``, ``<layer>.weight.absmax``, ...), its quant state
    rebuilt by ``QuantState.from_dict`` from the stored tensors: ``dst`` gets ``<layer>`` -> [N, K]."""
    import bitsandbytes.functional as bnb_functional
    import safetensors.torch
    import torch

    tensors = safetensors.torch.load_file(job["tensors"])
    out = {}
    for layer in job["layers"]:
        own = {
            key.removeprefix(f"{layer}.weight."): value
            for key, value in tensors.items()
            if key.startswith(f"{layer}.weight.")
        }
        state = bnb_functional.QuantState.from_dict(own, device=torch.device("cpu"))
        state.dtype = torch.float32
        out[layer] = bnb_functional.dequantize_4bit(tensors[f"{layer}.weight"], state).contiguous()
    safetensors.torch.save_file(out, job["dst"])


def _job(job: Mapping[str, Any]) -> None:
    if job.get("kind") == "dequantize":
        _dequantize_job(job)
        return
    import bitsandbytes
    import bitsandbytes.functional as bnb_functional
    import safetensors.torch
    import torch
    import transformers

    dst = Path(job["dst"])
    dtype = getattr(torch, job.get("dtype", "float32"))
    torch.manual_seed(int(job.get("seed", 0)))
    config = transformers.LlamaConfig(**job["model"])
    dense = transformers.LlamaForCausalLM(config).to(dtype).eval()
    dense.save_pretrained(dst / "dense")
    settings = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=job["quant_type"],
        bnb_4bit_use_double_quant=bool(job["double_quant"]),
        bnb_4bit_compute_dtype=dtype,
        llm_int8_skip_modules=job.get("skip_modules"),
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(
        dst / "dense", quantization_config=settings, device_map="cpu", dtype=dtype
    )
    model.save_pretrained(dst / "quantized")

    reference: dict[str, Any] = {}
    for name, module in model.named_modules():
        if not isinstance(module, bitsandbytes.nn.Linear4bit):
            continue
        weight = module.weight
        state = weight.quant_state
        reference[f"{name}.dequantized"] = bnb_functional.dequantize_4bit(weight.data, state).contiguous()
        absmax = state.absmax
        if state.nested:
            absmax = bnb_functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
        reference[f"{name}.dequantized_float32"] = torch.ops.bitsandbytes.dequantize_4bit(
            weight.data, absmax, state.blocksize, state.quant_type, state.shape, torch.float32
        ).contiguous()

    # transformers' own loader of the written checkpoint; several tokens, so that bitsandbytes takes
    # its dequantize-then-matmul path (one token would take its fused bf16 CPU gemv)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(dst / "quantized", device_map="cpu").eval()
    generator = torch.Generator().manual_seed(int(job.get("seed", 0)) + 1)
    input_ids = torch.randint(0, config.vocab_size, (1, int(job.get("tokens", 6))), generator=generator)
    with torch.no_grad():
        # what this CPU runs: with AVX512-BF16, bitsandbytes repacks the weight and multiplies in bfloat16
        reference["logits_native"] = loaded(input_ids).logits.float().contiguous()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(dst / "quantized", device_map="cpu").eval()
    for module in loaded.modules():
        if isinstance(module, bitsandbytes.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False  # bitsandbytes' path on every other CPU
    with torch.no_grad():
        reference["logits"] = loaded(input_ids).logits.float().contiguous()
    reference["input_ids"] = input_ids
    safetensors.torch.save_file(reference, dst / "reference.safetensors")


def _check() -> None:
    import bitsandbytes.functional
    import torch
    from transformers import BitsAndBytesConfig

    weight = torch.randn(8, 64)
    packed, state = bitsandbytes.functional.quantize_4bit(weight, quant_type="nf4", compress_statistics=True)
    restored = bitsandbytes.functional.dequantize_4bit(packed, state)
    if not bool(torch.isfinite(restored).all()):
        raise RuntimeError("bitsandbytes' CPU backend did not dequantize")
    if BitsAndBytesConfig(load_in_4bit=True).quant_method != "bitsandbytes":
        raise RuntimeError("transformers' BitsAndBytesConfig is not the one these checks expect")


def main(argv: Sequence[str]) -> int:
    if argv[:1] == ["--check"]:
        _check()
        return 0
    spec = json.loads(Path(argv[0]).read_text())
    for job in spec["jobs"]:
        _job(job)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
