"""Small Llama-shaped checkpoints of any scheme and shape, for the tensor-parallel tests.

Each projection's random weight is quantized with ``qscheme.quantize_weight`` (the producer's
arithmetic, checked against compressed-tensors and ModelOpt in test_quantize_*), and the
producer config is the one ``qscheme.writing.producer_config`` writes (compressed-tensors
``quantization_config``, ModelOpt ``hf_quant_config.json``, or a self-describing config for a
YAML-only scheme). The shapes are chosen per test, so that a split works or cuts a unit on
purpose. q/k/v get different weight magnitudes, so NVFP4 global scales differ across them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from kernel_fakes import input_scales
from safetensors.torch import save_file

from qscheme.catalog import load_scheme
from qscheme.descriptor import Scheme, parse_scheme_text
from qscheme.quantize import quantize_weight
from qscheme.writing.producer_config import config_files

HIDDEN = 256
INTERMEDIATE = 512
LLAMA = {
    "self_attn.q_proj": (HIDDEN, HIDDEN),
    "self_attn.k_proj": (HIDDEN, HIDDEN),
    "self_attn.v_proj": (HIDDEN, HIDDEN),
    "self_attn.o_proj": (HIDDEN, HIDDEN),
    "mlp.gate_proj": (INTERMEDIATE, HIDDEN),
    "mlp.up_proj": (INTERMEDIATE, HIDDEN),
    "mlp.down_proj": (HIDDEN, INTERMEDIATE),
}
MAGNITUDE = {"self_attn.k_proj": 3.0, "self_attn.v_proj": 0.6, "mlp.gate_proj": 0.5}
PRE_SCALED = ("self_attn.o_proj", "mlp.down_proj")  # AWQ layers whose smoothing cannot fold into a norm


def write_checkpoint(
    folder: Path,
    scheme: str | Scheme,
    projections: Mapping[str, tuple[int, int]] = LLAMA,
    *,
    layers: int = 1,
    bias: bool = False,
    seed: int = 0,
    descriptor_text: str | None = None,
) -> Path:
    """Write config files and model.safetensors for ``layers`` decoder layers into ``folder``.

    ``descriptor_text`` (a YAML-only scheme) writes a self-describing checkpoint of that scheme.
    """
    resolved = parse_scheme_text(descriptor_text, "<test>") if descriptor_text else load_scheme(scheme)
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(64, HIDDEN, generator=generator) * 0.02,
        "model.norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": torch.randn(64, HIDDEN, generator=generator) * 0.02,
    }
    for index in range(layers):
        prefix = f"model.layers.{index}"
        for name, (n, k) in projections.items():
            weight = torch.randn(n, k, generator=generator) * 0.05 * MAGNITUDE.get(name, 1.0)
            given = input_scales(resolved, 4.0 * MAGNITUDE.get(name, 1.0))
            if resolved.input_pre_scale is not None and name in PRE_SCALED:
                given[resolved.input_pre_scale.name] = torch.rand(k, generator=generator) + 0.5
            for short, value in quantize_weight(weight, resolved, **given).items():
                tensors[f"{prefix}.{name}.{short}"] = value.contiguous()
            if bias:
                tensors[f"{prefix}.{name}.bias"] = torch.randn(n, generator=generator) * 0.1
    source = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN}
    files = config_files(
        resolved, source, ignore=["lm_head"], unquantized_modules=["lm_head"], descriptor_text=descriptor_text
    )
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (folder / name).write_text(json.dumps(content, indent=2) + "\n")
    save_file(tensors, str(folder / "model.safetensors"))
    return folder
