"""Tiny GGUF files for the GGUF loading tests, written by gguf-py itself (the producer).

``write_tiny_gguf`` builds a tiny transformers model with random weights (hidden 256, so that
K-quant types fit, two layers), names its tensors with gguf-py's tables the way llama.cpp's
converter does (transformers' map read backwards), applies llama.cpp's q/k row permutation for
the llama family (written here from llama.cpp's converter, independently of the code under
test), quantizes with ``gguf.quants.quantize`` and writes the file with ``gguf.GGUFWriter``.
``reference_state`` is the oracle: transformers' own ``load_gguf_checkpoint`` (gguf-py's
dequantizer and transformers' reverse permutation) for a model built from the file's config.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

HIDDEN = 256
LAYERS = 2
VOCAB = 64

# family -> (GGUF architecture, transformers config class name, config arguments)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("llama", "LlamaConfig", {"intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}),
    "mistral": (
        "llama",
        "MistralConfig",
        {"intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64},
    ),
    "qwen2": ("qwen2", "Qwen2Config", {"intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}),
    # transformers' qwen3 GGUF table reads no attention.key_length: head_dim stays the class's 128
    "qwen3": (
        "qwen3",
        "Qwen3Config",
        {"intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128},
    ),
    "qwen3moe": (
        "qwen3moe",
        "Qwen3MoeConfig",
        {
            "intermediate_size": 512,
            "moe_intermediate_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
        },
    ),
}

TypeChoice = Callable[[str, tuple[int, ...]], str]  # (GGUF tensor name, torch shape) -> ggml type name


def uniform(kind: str) -> TypeChoice:
    """Every 2-D/3-D weight in ``kind``, except the MoE router (llama.cpp keeps it F32); 1-D tensors F32."""
    return lambda name, shape: kind if len(shape) >= 2 and ".ffn_gate_inp." not in name else "F32"


Q8_0 = uniform("Q8_0")


@dataclass
class TinyGGUF:
    path: Path
    family: str
    model: Any  # the random transformers model the file was written from
    types: dict[str, str]  # GGUF tensor -> ggml type


def tiny_model(family: str, tie: bool = False, seed: int = 0) -> Any:
    _, config_class, arguments = FAMILIES[family]
    config = getattr(transformers, config_class)(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-6,
        **arguments,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(1.0 + 0.1 * torch.randn_like(parameter))  # not all ones: a misplaced norm shows
    return model.eval()


def _llamacpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf LlamaModel.permute: rows of each head interleaved in pairs."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _names(model: Any, family: str) -> dict[str, list[str]]:
    """transformers parameter -> GGUF tensor name(s), from transformers' own map read backwards."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    architecture = FAMILIES[family][0]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config={})
    mapping = get_gguf_hf_weights_map(model, processor, model_type=architecture)
    backwards: dict[str, list[str]] = {}
    for gguf_name, hf_name in mapping.items():
        backwards.setdefault(hf_name, []).append(gguf_name)
    return backwards


def write_tiny_gguf(
    path: Path,
    family: str,
    types: TypeChoice = Q8_0,
    *,
    tie: bool = False,
    seed: int = 0,
    extra: Mapping[str, np.ndarray] | None = None,
    metadata: Mapping[str, Any] | None = None,
    architecture: str | None = None,
) -> TinyGGUF:
    """Write a tiny ``family`` model to ``path`` as llama.cpp would (see the module docstring)."""
    model = tiny_model(family, tie=tie, seed=seed)
    config = model.config
    arch = architecture or FAMILIES[family][0]
    writer = gguf.GGUFWriter(str(path), arch)
    # transformers tells Mistral (a llama file) apart by general.name == "mistral"
    writer.add_name("mistral" if family == "mistral" else f"tiny-{family}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(256)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_vocab_size(config.vocab_size)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    if family == "qwen3moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, value)

    state = {name: value.detach().float().numpy() for name, value in model.state_dict().items()}
    names = _names(model, family)
    tensors: dict[str, np.ndarray] = {}
    for hf_name, value in state.items():
        if tie and hf_name == "lm_head.weight":
            continue
        targets = names.get(hf_name)
        assert targets, f"no GGUF name for {hf_name}"
        if hf_name.endswith("experts.gate_up_proj"):
            inner = value.shape[1] // 2
            parts = {"ffn_gate_exps": value[:, :inner], "ffn_up_exps": value[:, inner:]}
            for target in targets:
                kind = target.rpartition(".")[2]
                tensors[f"{target}.weight"] = np.ascontiguousarray(parts[kind])
            continue
        (target,) = targets
        if not target.endswith((".weight", ".bias")):
            target += ".weight"
        if arch == "llama" and ".attn_q." in target:
            value = _llamacpp_permute(value, config.num_attention_heads)
        elif arch == "llama" and ".attn_k." in target:
            value = _llamacpp_permute(value, config.num_key_value_heads)
        tensors[target] = value
    tensors.update(extra or {})
    chosen: dict[str, str] = {}
    for name, value in tensors.items():
        kind = types(name, value.shape)
        chosen[name] = kind
        qtype = gguf.GGMLQuantizationType[kind]
        if kind in ("F32", "F16"):
            writer.add_tensor(name, value.astype(np.float32 if kind == "F32" else np.float16))
        else:
            writer.add_tensor(name, _quantized(value.astype(np.float32), kind), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyGGUF(path, family, model, chosen)


def _quantized(values: np.ndarray, kind: str) -> np.ndarray:
    """gguf-py's quantizer; for the types it only dequantizes (the k-quants), llama.cpp's reference
    quantizer as qscheme reproduces it (which bytes are written does not matter to these tests:
    the oracle is gguf-py's dequantizer reading them)."""
    try:
        return gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind])
    except NotImplementedError:
        from qscheme.producers.gguf.quants import quantize_blocks

        rows = torch.from_numpy(values.reshape(-1, values.shape[-1]).copy())
        packed = quantize_blocks(rows, kind).numpy()
        return packed.reshape(*values.shape[:-1], packed.shape[-1])


def config_of(path: Path) -> Any:
    from qscheme.checkpoint.gguf_names import gguf_model_config

    return gguf_model_config(path)


def model_of(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    """A fresh transformers model built from the file's config (random weights)."""
    torch.manual_seed(1)
    return transformers.AutoModelForCausalLM.from_config(config_of(path), dtype=dtype).eval()


def reference_state(path: Path) -> dict[str, torch.Tensor]:
    """transformers' own dequantized, un-permuted tensors of the file (its GGUF loader)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config_of(path))
    if model.config.model_type == "mistral":
        # transformers maps names by model type, and gguf-py has no "mistral" (llama.cpp writes
        # Mistral as llama): the reference maps this model's names as the llama they are.
        model.config.model_type = "llama"
    with contextlib.redirect_stderr(io.StringIO()):
        parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    return {name: value.float() for name, value in parsed["tensors"].items()}


def dense_model(path: Path) -> Any:
    """A float32 model holding the reference tensors: the logits qscheme's model must give."""
    model = model_of(path)
    state = reference_state(path)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert set(missing) <= tied and not unexpected, (missing, unexpected)
    return model
