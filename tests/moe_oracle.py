"""Tiny Qwen3-MoE checkpoints written by the producers' own code, for tests/test_moe_producers.py.

Run as a script in an oracle side venv (never imports qscheme)::

    python moe_oracle.py SPEC.json

SPEC holds ``jobs``; each builds a tiny seeded float32 ``Qwen3MoeForCausalLM`` (``model``: Qwen3MoeConfig
keywords) and writes ``dst``:

- ``kind: gptq`` / ``awq`` (the gptq venv: GPTQModel 7.7.0 / AutoAWQ 0.2.9): transformers holds the
  experts fused (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]); GPTQModel and AutoAWQ quantize
  MoE checkpoints per expert, so each expert's ``gate_proj``/``up_proj``/``down_proj`` becomes an
  ``nn.Linear`` named ``model.layers.L.mlp.experts.E.<proj>`` (the checkpoint names transformers'
  ``save_pretrained`` writes), and it and every attention projection are packed by the library
  exactly as tests/gptq_oracle.py packs a Llama's layers (its job functions, reused: GPTQModel's
  ``TorchLinear.pack`` and v2 -> v1 conversion, AutoAWQ's ``WQLinear_GEMM.from_linear``). The router
  (``mlp.gate``), norms, embeddings and lm_head stay float32, as those libraries leave them.
  ``dst/model.safetensors``, ``dst/config.json`` and ``dst/reference.safetensors`` (the library's own
  dequantization, ``<module>.dequantized`` [N, K]).
- ``kind: auto_round`` (the gptq venv: auto-round 0.16.1): ``AutoRound(model, bits=, group_size=, sym=,
  iters=0)`` (round-to-nearest) and ``quantize_and_save(format="auto_round")``: AutoRound itself
  unfuses the experts into per-expert Linears and packs them (``packing_format:
  auto_round:auto_gptq``), leaving the router float. The reference is AutoRound's own packing
  class run on the identity, as tests/auto_round_oracle.py computes it (its helpers, reused).
- ``kind: bitsandbytes`` (the bitsandbytes venv: bitsandbytes 0.50.2, transformers 5.24): the dense
  model is saved to ``dst/dense`` and loaded back with ``BitsAndBytesConfig(load_in_4bit=True,
  bnb_4bit_quant_type=nf4, ...)``; its ``save_pretrained`` writes ``dst/quantized``. Whatever
  transformers' integration quantizes is what the checkpoint holds (it replaces ``nn.Linear``
  modules only; fused experts stay float). ``dst/reference.safetensors``: bitsandbytes' own
  ``dequantize_4bit`` of every ``Linear4bit`` (``<module>.dequantized``), ``input_ids``, and
  ``logits`` of transformers' own loader of ``dst/quantized`` on bitsandbytes' dequantize-then-matmul
  CPU path.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def _model(job: Mapping[str, Any]) -> Any:
    import torch
    import transformers

    torch.manual_seed(int(job.get("seed", 0)))
    config = transformers.Qwen3MoeConfig(**job["model"])
    config.architectures = ["Qwen3MoeForCausalLM"]
    return transformers.Qwen3MoeForCausalLM(config).eval()


def _per_expert_tree(model: Any) -> Any:
    """An object whose ``model.layers`` holds each layer's attention and per-expert ``nn.Linear``s."""
    import torch

    layers = torch.nn.ModuleList()
    for layer in model.model.layers:
        fused = layer.mlp.experts
        half = fused.gate_up_proj.shape[1] // 2
        experts = torch.nn.ModuleList()
        for e in range(fused.gate_up_proj.shape[0]):
            expert = torch.nn.Module()
            for name, weight in (
                ("gate_proj", fused.gate_up_proj[e, :half]),
                ("up_proj", fused.gate_up_proj[e, half:]),
                ("down_proj", fused.down_proj[e]),
            ):
                linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
                linear.weight.data.copy_(weight.detach())
                setattr(expert, name, linear)
            experts.append(expert)
        mlp = torch.nn.Module()
        mlp.experts = experts
        holder = torch.nn.Module()
        holder.self_attn = layer.self_attn
        holder.mlp = mlp
        layers.append(holder)
    tree = torch.nn.Module()
    tree.model = torch.nn.Module()
    tree.model.layers = layers
    return tree


_LIBRARIES: dict[str, Any] = {}


def _packed_job(job: Mapping[str, Any]) -> None:
    from safetensors.torch import save_file

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gptq_oracle

    if not _LIBRARIES:  # entered once per process (it registers the packages' namespaces)
        _LIBRARIES.update(gptq_oracle._import_libraries())
    libs = _LIBRARIES
    model = _model(job)
    tree = _per_expert_tree(model)
    make = gptq_oracle._gptq_job if job["kind"] == "gptq" else gptq_oracle._awq_job
    quantized, extra = make(job, tree, libs)
    plain: dict[str, Any] = {}
    for name, value in model.state_dict().items():
        if ".mlp.experts." in name:
            continue  # the fused experts: every expert projection is in ``quantized``
        plain[name] = value.contiguous()
    quantized_modules = {name.rpartition(".")[0] for name in quantized}
    state = {name: value for name, value in plain.items() if name.rpartition(".")[0] not in quantized_modules}
    state.update(quantized)
    dst = Path(job["dst"])
    dst.mkdir(parents=True, exist_ok=True)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    save_file(extra["reference"], str(dst / "reference.safetensors"))
    document = model.config.to_dict()
    document["quantization_config"] = extra["quantization_config"]
    (dst / "config.json").write_text(json.dumps(document, indent=2, default=str))


def _auto_round_job(job: Mapping[str, Any]) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import auto_round_oracle

    libs = auto_round_oracle.import_libraries()
    dst = Path(job["dst"])
    scratch = dst.with_name(dst.name + ".autoround")
    rounder = libs["AutoRound"](
        _model(job),
        tokenizer=auto_round_oracle._tokenizer(),
        bits=int(job["bits"]),
        group_size=int(job["group_size"]),
        sym=bool(job["sym"]),
        iters=0,
        disable_opt_rtn=True,
    )
    rounder.quantize_and_save(str(scratch), format="auto_round")
    written = next(path.parent for path in sorted(scratch.rglob("config.json")))
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(written / name, dst / name)
    shutil.rmtree(scratch)
    section = json.loads((dst / "config.json").read_text())["quantization_config"]
    values = {key: section[key] for key in ("bits", "group_size", "sym")}
    state = load_file(str(dst / "model.safetensors"))
    reference = {}
    for module in sorted({name.rpartition(".")[0] for name in state if name.endswith(".qweight")}):
        tensors = {name.rpartition(".")[2]: value for name, value in state.items() if name.startswith(f"{module}.")}
        reference[f"{module}.dequantized"] = auto_round_oracle._dequantized(
            libs, section["packing_format"], values, tensors
        )
    save_file(reference, str(dst / "reference.safetensors"))


def _bitsandbytes_job(job: Mapping[str, Any]) -> None:
    import bitsandbytes
    import bitsandbytes.functional as bnb_functional
    import safetensors.torch
    import torch
    import transformers

    dst = Path(job["dst"])
    model = _model(job)
    model.save_pretrained(dst / "dense")
    settings = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=job["quant_type"],
        bnb_4bit_use_double_quant=bool(job["double_quant"]),
        bnb_4bit_compute_dtype=torch.float32,
    )
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        dst / "dense", quantization_config=settings, device_map="cpu", dtype=torch.float32
    )
    loaded.save_pretrained(dst / "quantized")
    reference: dict[str, Any] = {}
    for name, module in loaded.named_modules():
        if isinstance(module, bitsandbytes.nn.Linear4bit):
            weight = module.weight
            reference[f"{name}.dequantized"] = bnb_functional.dequantize_4bit(weight.data, weight.quant_state)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(dst / "quantized", device_map="cpu").eval()
    for module in theirs.modules():
        if isinstance(module, bitsandbytes.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False  # the dequantize-then-matmul path
    generator = torch.Generator().manual_seed(int(job.get("seed", 0)) + 1)
    input_ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=generator)
    with torch.no_grad():
        reference["logits"] = theirs(input_ids).logits.float()
    reference["input_ids"] = input_ids
    safetensors.torch.save_file({k: v.contiguous() for k, v in reference.items()}, dst / "reference.safetensors")


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    for job in spec["jobs"]:
        {"bitsandbytes": _bitsandbytes_job, "auto_round": _auto_round_job}.get(job["kind"], _packed_job)(job)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
