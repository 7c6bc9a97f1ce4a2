"""SourceCheckpoint: shards in order, tensors one at a time, files to copy, bad inputs refused.

Also home of ``write_source_checkpoint``, the unquantized tiny-Llama checkpoint the writing
tests quantize (plain safetensors, no model library needed).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qscheme.errors import CheckpointError, CheckpointNotFoundError
from qscheme.writing.source import SourceCheckpoint

HIDDEN, INTERMEDIATE, KV, VOCAB = 128, 256, 64, 256
OTHER_FILES = {
    "tokenizer.json": '{"version": "1.0", "model": {"type": "BPE"}}\n',
    "generation_config.json": '{"bos_token_id": 1, "eos_token_id": 2}\n',
}


def llama_tensors(num_layers: int = 2, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> dict[str, torch.Tensor]:
    """A tiny Llama's state dict: q [128,128], k/v [64,128], gate/up [256,128], down [128,256].
    k_proj is scaled up so that q/k/v have clearly different absmax (as gate/up do)."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.05) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    tensors = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN)}
    for i in range(num_layers):
        prefix = f"model.layers.{i}"
        tensors[f"{prefix}.input_layernorm.weight"] = torch.ones(HIDDEN, dtype=dtype)
        tensors[f"{prefix}.self_attn.q_proj.weight"] = rand(HIDDEN, HIDDEN)
        tensors[f"{prefix}.self_attn.k_proj.weight"] = rand(KV, HIDDEN, scale=0.15)
        tensors[f"{prefix}.self_attn.v_proj.weight"] = rand(KV, HIDDEN, scale=0.03)
        tensors[f"{prefix}.self_attn.o_proj.weight"] = rand(HIDDEN, HIDDEN)
        tensors[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(HIDDEN, dtype=dtype)
        tensors[f"{prefix}.mlp.gate_proj.weight"] = rand(INTERMEDIATE, HIDDEN, scale=0.02)
        tensors[f"{prefix}.mlp.up_proj.weight"] = rand(INTERMEDIATE, HIDDEN)
        tensors[f"{prefix}.mlp.down_proj.weight"] = rand(HIDDEN, INTERMEDIATE)
    tensors["model.norm.weight"] = torch.ones(HIDDEN, dtype=dtype)
    tensors["lm_head.weight"] = rand(VOCAB, HIDDEN)
    return tensors


def write_source_checkpoint(
    folder: Path,
    tensors: dict[str, torch.Tensor] | None = None,
    shards: Sequence[Sequence[str]] | None = None,
    config: dict[str, object] | None = None,
) -> Path:
    """An unquantized HF folder: config.json, other files, one model.safetensors or the given shards
    (lists of tensor names, in order; every tensor must be in one)."""
    tensors = llama_tensors() if tensors is None else tensors
    folder.mkdir(parents=True, exist_ok=True)
    base = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "torch_dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config if config is not None else base, indent=2))
    for name, text in OTHER_FILES.items():
        (folder / name).write_text(text)
    if shards is None:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder
    weight_map = {}
    count = len(shards)
    for index, names in enumerate(shards, start=1):
        file = f"model-{index:05d}-of-{count:05d}.safetensors"
        save_file({name: tensors[name] for name in names}, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index_data = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_data, indent=2))
    return folder


def three_shards(tensors: dict[str, torch.Tensor]) -> list[list[str]]:
    """Split so that layer 0's q_proj sits in shard 1 and its k/v_proj in shard 2 (a fused group
    spanning two shards), and layer 1 fills shard 3."""
    names = list(tensors)
    cut = names.index("model.layers.0.self_attn.k_proj.weight")
    second = names.index("model.layers.1.input_layernorm.weight")
    return [names[:cut], names[cut:second], names[second:]]


def test_sharded_folder_lists_shards_in_order_and_reads_tensors(tmp_path: Path) -> None:
    tensors = llama_tensors()
    shards = three_shards(tensors)
    source = SourceCheckpoint.open(write_source_checkpoint(tmp_path / "src", tensors, shards))
    assert source.sharded
    assert [shard.name for shard in source.shards] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [list(shard.tensors) for shard in source.shards] == [sorted(names) for names in shards]
    for name, tensor in tensors.items():
        assert torch.equal(source.read(name), tensor)
    assert [path.name for path in source.other_files()] == sorted(OTHER_FILES)
    assert source.config["model_type"] == "llama"
    assert source.largest_tensor_bytes == VOCAB * HIDDEN * 2


def test_single_file_and_lone_safetensors(tmp_path: Path) -> None:
    folder = write_source_checkpoint(tmp_path / "src")
    source = SourceCheckpoint.open(folder)
    assert not source.sharded and source.output_shard_name(source.shards[0]) == "model.safetensors"
    lone = SourceCheckpoint.open(folder / "model.safetensors")
    assert lone.other_files() == [] and lone.config == {}
    assert set(lone.tensors) == set(source.tensors)


def test_skips_index_quant_configs_and_hidden_files(tmp_path: Path) -> None:
    folder = write_source_checkpoint(tmp_path / "src")
    (folder / "hf_quant_config.json").write_text("{}")
    (folder / ".cache").mkdir()
    (folder / "extra").mkdir()
    (folder / "extra" / "notes.txt").write_text("x")
    names = [path.name for path in SourceCheckpoint.open(folder).other_files()]
    assert names == ["extra", *sorted(OTHER_FILES)]


def test_missing_and_bad_inputs_are_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        SourceCheckpoint.open(tmp_path / "nowhere")
    (tmp_path / "file.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"not a \.safetensors file"):
        SourceCheckpoint.open(tmp_path / "file.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="neither"):
        SourceCheckpoint.open(tmp_path / "empty")


def test_a_file_rewritten_after_opening_is_refused(tmp_path: Path) -> None:
    folder = write_source_checkpoint(tmp_path / "src", {"a.weight": torch.ones(4, 4)})
    source = SourceCheckpoint.open(folder)
    save_file({"a.weight": torch.zeros(4, 4)}, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="changed since its header was checked"):
        source.read("a.weight")
