"""AutoRound as an oracle: tiny Llama checkpoints quantized and exported by AutoRound's own code, and
its own CPU dequantization of every quantized layer.

Two halves in one file, like the other oracles:

- run as a script under the Python of ``QSCHEME_GPTQ_PYTHON`` (the side venv of
  ``scripts/oracle-venv.sh gptq``, which also holds auto-round 0.16.1 installed without its
  dependencies)::

      python auto_round_oracle.py SPEC.json        # or --check: import what the jobs use

  SPEC holds ``jobs``; each builds a tiny LlamaForCausalLM (``model``: LlamaConfig keywords, float32,
  seeded) and runs ``AutoRound(model, tokenizer, bits=, group_size=, sym=, iters=0,
  layer_config=...)`` (its round-to-nearest mode: no calibration data) and ``quantize_and_save(dst,
  format=...)``: AutoRound's own quantizer, exporter (``save_quantized_as_autoround``: the config
  with ``packing_format``, ``block_name_to_quantize`` and ``extra_config``) and packing classes.
  It then writes ``reference.safetensors`` with, per quantized module, ``<module>.dequantized``: the
  weight AutoRound's own layer computes, [N, K] in float32: the packing class AutoRound's exporter
  picks for the module (``dynamic_import_quant_linear_for_packing``) loaded with the saved tensors
  (scales in float32, so its product is exact) and run on the identity (its forward dequantizes and
  multiplies), or for AutoAWQ's layout its ``dequantize_gemm``.

  AutoRound imports ``datasets`` only for calibration data; that module is replaced by one whose
  functions raise, so a job that needed data would fail loudly. Only torch, transformers,
  tokenizers, safetensors and auto_round are imported, never qscheme.

- imported by tests (main venv): ``oracle_python()`` and ``build_checkpoints``.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ENV = "QSCHEME_GPTQ_PYTHON"


def oracle_python() -> str:
    """The oracle venv's Python, or skip the calling test (CI always sets it)."""
    import oracle_jobs  # the tests' helper; the oracle side (run as a script in the venv) needs none

    return oracle_jobs.oracle_python(ENV, "gptq")


def build_checkpoints(jobs: Sequence[Mapping[str, Any]], *, python: str | None = None, timeout: float = 600) -> None:
    """Write each job's checkpoint (see the module docstring) in one oracle process."""
    import oracle_jobs

    oracle_jobs.run_jobs(__file__, jobs, python=python or oracle_python(), label="AutoRound", timeout=timeout)


# ----------------------------------------------------------------------------- the oracle side


def _without_calibration_data() -> None:
    """AutoRound imports ``datasets`` for calibration data, which round-to-nearest never loads."""
    import types

    module = types.ModuleType("datasets")

    def absent(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the AutoRound oracle has no calibration data (iters=0 needs none)")

    for name in ("Dataset", "Features", "IterableDataset", "Sequence", "Value"):
        setattr(module, name, type(name, (), {}))
    for name in ("concatenate_datasets", "load_dataset", "load_from_disk"):
        setattr(module, name, absent)
    sys.modules["datasets"] = module


def import_libraries() -> dict[str, Any]:
    _without_calibration_data()
    from auto_round import AutoRound
    from auto_round.export.export_to_autoround.export import dynamic_import_quant_linear_for_packing
    from auto_round.export.export_to_awq.utils import dequantize_gemm

    return {
        "AutoRound": AutoRound,
        "packing_class": dynamic_import_quant_linear_for_packing,
        "dequantize_gemm": dequantize_gemm,
    }


def _tokenizer() -> Any:
    """A one-word tokenizer: AutoRound requires one, round-to-nearest never tokenizes."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocabulary = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=vocabulary, unk_token="<unk>")


def _dequantized(libs: Mapping[str, Any], packing: str, values: Mapping[str, Any], tensors: Mapping[str, Any]) -> Any:
    """AutoRound's own weight [N, K] for one module's saved tensors."""
    import torch

    bits, group_size, sym = int(values["bits"]), int(values["group_size"]), bool(values["sym"])
    if "awq" in packing:
        scales = tensors["scales"].float()
        weight = libs["dequantize_gemm"](tensors["qweight"], tensors["qzeros"], scales, bits, group_size)
        return weight.T.contiguous().float()
    k, n = tensors["scales"].shape[0] * (group_size if group_size != -1 else 0), tensors["scales"].shape[1]
    k = k or tensors["qweight"].shape[0] * 32 // bits
    layer = libs["packing_class"](packing, bits, group_size, sym)(bits, group_size, k, n, False)
    for name in ("qweight", "qzeros"):
        setattr(layer, name, tensors[name].clone())
    layer.scales = tensors["scales"].float()
    if "g_idx" in tensors:
        layer.g_idx = tensors["g_idx"].clone()
    with torch.no_grad():
        return layer(torch.eye(k, dtype=torch.float32)).T.contiguous()


def _run_job(job: Mapping[str, Any], libs: Mapping[str, Any]) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(int(job.get("seed", 0)))
    config = LlamaConfig(**job["model"])
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config).eval()
    dst = Path(job["dst"])
    scratch = dst.with_name(dst.name + ".autoround")
    rounder = libs["AutoRound"](
        model,
        tokenizer=_tokenizer(),
        bits=int(job["bits"]),
        group_size=int(job["group_size"]),
        sym=bool(job["sym"]),
        iters=0,
        disable_opt_rtn=True,
        layer_config=dict(job.get("layer_config") or {}),
    )
    rounder.quantize_and_save(str(scratch), format=job.get("format", "auto_round"))
    written = next(path.parent for path in sorted(scratch.rglob("config.json")))
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(written / name, dst / name)
    shutil.rmtree(scratch)

    document = json.loads((dst / "config.json").read_text())
    section = document["quantization_config"]
    packing = section["packing_format"]
    state = load_file(str(dst / "model.safetensors"))
    modules = sorted({name.rpartition(".")[0] for name in state if name.endswith(".qweight")})
    reference = {}
    for module in modules:
        values = {key: section[key] for key in ("bits", "group_size", "sym")}
        override = (section.get("extra_config") or {}).get(module, {})
        values.update({key: value for key, value in override.items() if key in values})
        tensors = {name.rpartition(".")[2]: value for name, value in state.items() if name.startswith(f"{module}.")}
        reference[f"{module}.dequantized"] = _dequantized(libs, packing, values, tensors)
    save_file(reference, str(dst / "reference.safetensors"))


def main(argv: Sequence[str]) -> None:
    libs = import_libraries()
    if argv[1:] == ["--check"]:
        return
    spec = json.loads(Path(argv[1]).read_text())
    for job in spec["jobs"]:
        _run_job(job, libs)


if __name__ == "__main__":
    main(sys.argv)
