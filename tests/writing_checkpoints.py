"""Small unquantized bf16 Hugging Face checkpoints for the checkpoint-writing tests and benchmark.

A Llama-like layout (embed_tokens, per layer q/k/v/o, gate/up/down and two norms, the final norm,
lm_head), written as ``model-0000i-of-0000n.safetensors`` shards with
``model.safetensors.index.json``, beside a transformers-loadable ``config.json`` and the files a
quantizer must copy through unchanged (tokenizer, generation config), written here: no hub
download. Shards are cut so that fused groups (q/k/v and gate/up) straddle two shards, the case
where a shard-by-shard quantizer must still give the group one global scale.

Weights are seeded random normals with a different magnitude per partition (k_proj x3, v_proj
x0.7, gate_proj x0.5, one outlier row in up_proj), so a fused group's partitions have different
absolute maxima and a shared global scale differs from a per-partition one.

Also the helpers the writing tests share: ``qscheme_quantize`` (the CLI in this process),
``read_tensors`` and ``same_bytes``. torch and safetensors are imported where used, so the
benchmark's parent process can use this module without holding torch's memory (a child's peak
RSS counts what it was forked from).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SEED = 20240917
PARTITION_MULTIPLIERS = {"self_attn.k_proj": 3.0, "self_attn.v_proj": 0.7, "mlp.gate_proj": 0.5}
FUSED_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))
COPIED_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class LlamaShape:
    """The dimensions of a Llama-like model (a head is 32 wide, so K stays a multiple of 128)."""

    hidden: int = 128
    intermediate: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 256

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tensor_shapes(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """Every tensor's name and shape, in the order transformers writes a Llama."""
        kv = self.kv_heads * self.head_dim
        yield "model.embed_tokens.weight", (self.vocab, self.hidden)
        for i in range(self.layers):
            prefix = f"model.layers.{i}"
            yield f"{prefix}.input_layernorm.weight", (self.hidden,)
            yield f"{prefix}.self_attn.q_proj.weight", (self.hidden, self.hidden)
            yield f"{prefix}.self_attn.k_proj.weight", (kv, self.hidden)
            yield f"{prefix}.self_attn.v_proj.weight", (kv, self.hidden)
            yield f"{prefix}.self_attn.o_proj.weight", (self.hidden, self.hidden)
            yield f"{prefix}.post_attention_layernorm.weight", (self.hidden,)
            yield f"{prefix}.mlp.gate_proj.weight", (self.intermediate, self.hidden)
            yield f"{prefix}.mlp.up_proj.weight", (self.intermediate, self.hidden)
            yield f"{prefix}.mlp.down_proj.weight", (self.hidden, self.intermediate)
        yield "model.norm.weight", (self.hidden,)
        yield "lm_head.weight", (self.vocab, self.hidden)

    def linear_modules(self) -> list[str]:
        """The modules a quantizer turns into quantized Linear layers (lm_head excluded)."""
        return [name[: -len(".weight")] for name, _ in self.tensor_shapes() if name.endswith("_proj.weight")]

    def config(self) -> dict[str, object]:
        """A config.json transformers builds a LlamaForCausalLM from."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "max_position_embeddings": 128,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "dtype": "bfloat16",
        }


def tensor_value(name: str, shape: tuple[int, ...], seed: int = SEED) -> torch.Tensor:
    """The bf16 value of one tensor: a pure function of its name, shape and the seed."""
    import torch

    generator = torch.Generator().manual_seed(seed + _name_hash(name))
    if len(shape) == 1:  # norms: around 1, as trained norms are
        return (1.0 + 0.1 * torch.randn(shape, generator=generator)).to(torch.bfloat16)
    value = torch.randn(shape, generator=generator) * (1.0 / math.sqrt(shape[1]))
    for partition, multiplier in PARTITION_MULTIPLIERS.items():
        if f".{partition}." in name:
            value *= multiplier
    if ".mlp.up_proj." in name:
        value[1] *= 8.0  # one outlier row: the group's absolute maximum, in one partition
    return value.to(torch.bfloat16)


def _name_hash(name: str) -> int:
    return sum((i + 1) * ord(c) for i, c in enumerate(name)) % 1_000_003


def shard_plan(shape: LlamaShape, shards: int, *, straddle: bool = True) -> list[list[str]]:
    """Tensor names per shard: equal-ish byte counts.

    With ``straddle`` every cut lands between two partitions of a fused group (after a q_proj or
    a gate_proj) nearest its byte target, so fused groups straddle shards; without it, cuts fall
    between layers. (llm-compressor 0.14's model_free_ptq refuses a shard that starts with the
    rest of a group and holds a whole group of the same kind after it: its shard check pairs
    names in sorted order. Its benchmark therefore cuts between layers.)
    """
    names = [name for name, _ in shape.tensor_shapes()]
    sizes = [math.prod(s) * 2 for _, s in shape.tensor_shapes()]
    total = sum(sizes)
    ends = ("self_attn.q_proj.weight", "mlp.gate_proj.weight") if straddle else ("mlp.down_proj.weight",)
    cut_candidates = [i + 1 for i, name in enumerate(names) if name.endswith(ends)]
    cuts: list[int] = []
    running = [sum(sizes[:i]) for i in range(len(names) + 1)]
    for k in range(1, shards):
        target = total * k / shards
        candidates = [c for c in cut_candidates if c not in cuts and (not cuts or c > cuts[-1])]
        if not candidates:
            raise ValueError(f"{shape} has too few fused groups to cut into {shards} shards")
        cuts.append(min(candidates, key=lambda c: abs(running[c] - target)))
    bounds = [0, *cuts, len(names)]
    return [names[bounds[i] : bounds[i + 1]] for i in range(shards)]


def write_bf16_checkpoint(
    folder: Path, shape: LlamaShape = LlamaShape(), *, shards: int = 3, straddle: bool = True, seed: int = SEED
) -> dict[str, list[str]]:
    """Write the checkpoint into ``folder`` (created); returns {shard file: its tensor names}."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    shapes = dict(shape.tensor_shapes())
    plan = shard_plan(shape, shards, straddle=straddle)
    weight_map: dict[str, str] = {}
    layout: dict[str, list[str]] = {}
    total_size = 0
    for index, names in enumerate(plan, start=1):
        file_name = f"model-{index:05d}-of-{shards:05d}.safetensors"
        tensors = {name: tensor_value(name, shapes[name], seed) for name in names}
        save_file(tensors, str(folder / file_name), metadata={"format": "pt"})
        total_size += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(names, file_name))
        layout[file_name] = names
    index_data = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_data, indent=2), encoding="utf-8")
    write_side_files(folder, shape)
    return layout


def write_side_files(folder: Path, shape: LlamaShape) -> None:
    """config.json and the files a writer copies through unchanged."""
    (folder / "config.json").write_text(json.dumps(shape.config(), indent=2), encoding="utf-8")
    generation = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False, "max_new_tokens": 8}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, shape.vocab)}}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
            | {"special": True}
            for i, t in enumerate(("<unk>", "<s>", "</s>"))
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer), encoding="utf-8")
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2), encoding="utf-8")
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2), encoding="utf-8")


# --- shared by the writing tests ------------------------------------------------------------------


def qscheme_quantize(src: Path, dst: Path, scheme: str, *extra: str) -> dict[str, object]:
    """``qscheme quantize SRC DST --scheme NAME --json [EXTRA...]`` in this process; its summary."""
    from qscheme.cli.main import main

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        status = main(["quantize", str(src), str(dst), "--scheme", scheme, "--json", *extra])
    if status != 0:
        raise AssertionError(f"qscheme quantize exited {status}: {stdout.getvalue()}")
    summary: dict[str, object] = json.loads(stdout.getvalue())
    return summary


def read_tensors(folder: Path) -> dict[str, tuple[str, torch.Tensor]]:
    """Every tensor of a checkpoint folder: name -> (shard file, tensor); a name in two shards fails."""
    from safetensors import safe_open

    found: dict[str, tuple[str, torch.Tensor]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            for name in handle.keys():
                if name in found:
                    raise AssertionError(f"{name} is in {found[name][0]} and {path.name}")
                found[name] = (path.name, handle.get_tensor(name))
    return found


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes."""
    import torch

    return bool(
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    )
