"""Write tiny gpt-oss MXFP4 checkpoints in the layout OpenAI's release uses (no download).

OpenAI's own writer (the gpt-oss conversion script) is not a package that installs here, so the
folder is built from the documented layout, which ``test_mxfp4_producer.py`` pins against
transformers' own reader (``transformers.integrations.mxfp4``): per MoE layer
``<experts>.gate_up_proj_blocks`` uint8 [E, 2I, H/32, 16], ``_scales`` uint8 (E8M0, bias 127)
[E, 2I, H/32], ``_bias`` bf16 [E, 2I] (gate rows even, up rows odd), and ``down_proj_*`` [E, H,
I/32, 16] / [E, H, I/32] / [E, H]; everything else (attention, router, embeddings, lm_head) bf16
as transformers' ``GptOssForCausalLM`` holds it. config.json carries ``quantization_config:
{"quant_method": "mxfp4", "modules_to_not_convert": [...]}`` as the release does.

Codes are random bytes; scales are drawn around 2**0 (bytes 120..130), so dequantized weights are
small and finite.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import GptOssConfig, GptOssForCausalLM

EXPERT_PROJECTIONS = ("gate_up_proj", "down_proj")
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]

Damage = Callable[[dict[str, torch.Tensor]], None]


def tiny_gpt_oss_config(num_layers: int = 2, experts: int = 4) -> GptOssConfig:
    """hidden 64, intermediate 128 (so gate_up [256, 64] and down [64, 128] are not square)."""
    config = GptOssConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=experts,
        num_experts_per_tok=2,
        vocab_size=128,
        max_position_embeddings=64,
        sliding_window=8,
        layer_types=[("sliding_attention", "full_attention")[index % 2] for index in range(num_layers)],
        tie_word_embeddings=False,
    )
    config.architectures = ["GptOssForCausalLM"]
    return config


def mxfp4_stack(rows: int, columns: int, experts: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (blocks uint8 [E, rows, columns/32, 16], scales uint8 [E, rows, columns/32])."""
    blocks = torch.randint(0, 256, (experts, rows, columns // 32, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(120, 131, (experts, rows, columns // 32), generator=generator, dtype=torch.uint8)
    return blocks, scales


def gpt_oss_state(config: GptOssConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """The tensors of a gpt-oss MXFP4 checkpoint for ``config``."""
    torch.manual_seed(seed)
    model = GptOssForCausalLM(config).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(seed + 1)
    state: dict[str, torch.Tensor] = {}
    hidden, inner, experts = config.hidden_size, config.intermediate_size, config.num_local_experts
    for name, value in model.state_dict().items():
        module, _, short = name.rpartition(".")
        if module.endswith("mlp.experts") and short in EXPERT_PROJECTIONS:
            rows, columns = (2 * inner, hidden) if short == "gate_up_proj" else (hidden, inner)
            blocks, scales = mxfp4_stack(rows, columns, experts, generator)
            state[f"{name}_blocks"] = blocks
            state[f"{name}_scales"] = scales
        elif short.endswith("_bias") and module.endswith("mlp.experts"):
            state[name] = (torch.randn(value.shape, generator=generator) * 0.1).to(torch.bfloat16)
        else:
            state[name] = value.detach().clone().contiguous()
    return state


def write_gpt_oss_checkpoint(
    folder: Path, config: GptOssConfig | None = None, damage: Damage | None = None, seed: int = 0
) -> Path:
    """A gpt-oss MXFP4 checkpoint folder (``damage`` edits the tensors before they are written)."""
    config = config or tiny_gpt_oss_config()
    state = gpt_oss_state(config, seed)
    if damage is not None:
        damage(state)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({name: value.contiguous() for name, value in state.items()}, str(folder / "model.safetensors"))
    values = config.to_dict()
    values["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": list(NOT_CONVERTED)}
    (folder / "config.json").write_text(json.dumps(values, indent=2))
    return folder
