"""Run under a Python that has nvidia-modelopt: ModelOpt's own export of an unquantized checkpoint.

    python writing_modelopt_export.py SPEC.json

SPEC holds ``src`` (an unquantized bf16 Llama checkpoint folder: config.json + safetensors
shards) and ``jobs``: a list of ``{"config": "W4A16_NVFP4_CFG" | "FP8_DEFAULT_CFG" | ...,
"dst": FOLDER, "calibration": FILE}``. For each job it builds a LlamaForCausalLM from the config
(no download), loads exactly the checkpoint's weights, runs ``mtq.quantize`` with that config
and max calibration over fixed random token batches, writes the input amax each quantized
linear's input quantizer observed (before export) to ``calibration`` as a qscheme calibration
file (``{"format": "qscheme-calibration/1", "input_amax": {module: float}}``), then exports with
``export_hf_checkpoint(model, export_dir=dst)``. Only torch, transformers and modelopt are
imported, never qscheme. As tests/fixtures/modelopt/generate.py, on CPU, single-threaded, seeded.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")

from safetensors import safe_open  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402  (before modelopt: avoids its import-cycle warnings)

SEED = 1234
CALIBRATION_BATCHES = 4
BATCH_SHAPE = (2, 16)


def load_model(src: Path) -> LlamaForCausalLM:
    config_data = json.loads((src / "config.json").read_text())
    config_data.pop("dtype", None)
    config = LlamaConfig(**config_data)
    config.architectures = ["LlamaForCausalLM"]  # the exporter iterates it
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.config.dtype = torch.bfloat16  # must stay a torch.dtype (a string breaks export)
    state = {}
    for shard in sorted(src.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as handle:
            state.update({name: handle.get_tensor(name) for name in handle.keys()})
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [name for name in missing if "rotary" not in name]:
        raise SystemExit(f"weights do not fit the model: missing {missing}, unexpected {unexpected}")
    return model


def export(src: Path, config_name: str, dst: Path, calibration: Path) -> None:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    model = load_model(src)
    generator = torch.Generator().manual_seed(SEED)
    vocab = model.config.vocab_size
    batches = [torch.randint(0, vocab, BATCH_SHAPE, generator=generator) for _ in range(CALIBRATION_BATCHES)]

    def forward_loop(module: torch.nn.Module) -> None:
        with torch.no_grad():
            for batch in batches:
                module(batch)

    mtq.quantize(model, getattr(mtq, config_name), forward_loop)
    input_amax = {}
    for name, module in model.named_modules():
        quantizer = getattr(module, "input_quantizer", None)
        weight_quantizer = getattr(module, "weight_quantizer", None)
        if weight_quantizer is None or not weight_quantizer.is_enabled:
            continue
        if quantizer is not None and quantizer.is_enabled and getattr(quantizer, "amax", None) is not None:
            input_amax[name] = float(quantizer.amax.float().max())
    calibration.write_text(json.dumps({"format": "qscheme-calibration/1", "input_amax": input_amax}, indent=1))
    export_hf_checkpoint(model, export_dir=str(dst))


def main() -> None:
    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    for job in spec["jobs"]:
        export(Path(spec["src"]), job["config"], Path(job["dst"]), Path(job["calibration"]))


if __name__ == "__main__":
    main()
