"""DeepSeek-style FP8-block checkpoints written from the documented layout (no library writes them
on a CPU: DeepSeek's own converter needs its Triton kernels on CUDA).

The layout, as DeepSeek-V3's README_WEIGHTS.md ("FP8 Weight Documentation") states it and
transformers' FineGrainedFP8 integration reads it:

- config.json ``quantization_config``: ``{"activation_scheme": "dynamic", "fmt": "e4m3",
  "quant_method": "fp8", "weight_block_size": [128, 128]}`` (DeepSeek-V3.1 adds
  ``"scale_fmt": "ue8m0"``);
- per quantized Linear: ``weight`` float8_e4m3fn [N, K] and ``weight_scale_inv`` float32
  [ceil(N/128), ceil(K/128)], "the dequantization scale for each weight block";
- "If the weight block is not aligned to 128, it is zero-padded to 128 before calculating the
  scale. After quantization, the padded portion is removed."; dequantization is
  "(128x128 weight block) * weight_scale_inv";
- 16-bit everything else (embeddings, norms, lm_head, MoE routers).

The quantization here is the published one: per block, scale = amax / 448 (e4m3's largest
value), code = e4m3(w / scale); ``ue8m0`` rounds each scale up to a power of two first (DeepSeek's
``fast_round_scale``: 2 ** ceil(log2(amax / 448))). An all-zero block keeps scale 1.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

E4M3_MAX = 448.0
BLOCK = (128, 128)


def quantize_blocks(
    weight: torch.Tensor, block: tuple[int, int] = BLOCK, ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes [N, K], float32 weight_scale_inv [ceil(N/R), ceil(K/C)]) by the published formula."""
    rows, columns = weight.shape
    r, c = block
    nr, nc = math.ceil(rows / r), math.ceil(columns / c)
    padded = torch.zeros(nr * r, nc * c, dtype=torch.float32)
    padded[:rows, :columns] = weight.float()
    blocks = padded.view(nr, r, nc, c)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = amax / E4M3_MAX
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    codes = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.view(nr * r, nc * c)[:rows, :columns].contiguous(), scale.contiguous()


def fp8_section(block: tuple[int, int] = BLOCK, scale_fmt: str | None = None, **extra: object) -> dict[str, object]:
    """The quantization_config DeepSeek-V3 ships (plus ``scale_fmt`` and any extra keys)."""
    section: dict[str, object] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(block),
    }
    if scale_fmt is not None:
        section["scale_fmt"] = scale_fmt
    section.update(extra)
    return section


def quantized_modules(model: torch.nn.Module) -> set[str]:
    """The Linear modules DeepSeek quantizes: every nn.Linear but lm_head and MoE routers."""
    return {
        name
        for name, module in model.named_modules()
        if type(module) is torch.nn.Linear and name != "lm_head" and not name.endswith("mlp.gate")
    }


def checkpoint_tensors(
    model: torch.nn.Module, block: tuple[int, int] = BLOCK, ue8m0: bool = False
) -> dict[str, torch.Tensor]:
    """The model's state dict in the FP8-block layout; a fused experts module (transformers 5's
    [E, 2I, H] ``gate_up_proj`` and [E, H, I] ``down_proj``) is stored per expert and projection,
    as DeepSeek stores its experts (``mlp.experts.<e>.gate_proj.weight``)."""
    linears = quantized_modules(model)
    tensors: dict[str, torch.Tensor] = {}

    def put(module: str, weight: torch.Tensor) -> None:
        codes, scale = quantize_blocks(weight, block, ue8m0)
        tensors[f"{module}.weight"] = codes
        tensors[f"{module}.weight_scale_inv"] = scale

    for name, value in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if leaf == "gate_up_proj" and value.dim() == 3:
            inner = value.shape[1] // 2
            for e in range(value.shape[0]):
                put(f"{module}.{e}.gate_proj", value[e, :inner])
                put(f"{module}.{e}.up_proj", value[e, inner:])
        elif leaf == "down_proj" and value.dim() == 3:
            for e in range(value.shape[0]):
                put(f"{module}.{e}.down_proj", value[e])
        elif module in linears and leaf == "weight":
            put(module, value)
        else:
            tensors[name] = value.contiguous()
    return tensors


def write_fp8_checkpoint(
    folder: Path,
    model: torch.nn.Module,
    *,
    block: tuple[int, int] = BLOCK,
    scale_fmt: str | None = None,
    edit: Callable[[dict[str, torch.Tensor]], None] | None = None,
    **config_extra: object,
) -> Path:
    """Write ``model`` as an FP8-block checkpoint; ``edit`` may damage the tensors before saving."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = checkpoint_tensors(model, block, ue8m0=scale_fmt == "ue8m0")
    if edit is not None:
        edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))
    model.config.save_pretrained(str(folder))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = fp8_section(block, scale_fmt, **config_extra)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder
