"""load_checkpoint of a GGUF file: transformers names, bit-exact layers, llama's q/k rows, experts, errors.

The files are written by gguf-py (tests/gguf_tiny.py); the oracle is transformers' own GGUF
loader (gguf-py's dequantizer and transformers' reverse permutation).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_tiny import Q8_0, reference_state, uniform, write_tiny_gguf

import qscheme
from qscheme.errors import CheckpointError, UsageError

gguf = pytest.importorskip("gguf")


def mixed(name: str, shape: tuple[int, ...]) -> str:
    """Q4_K attention, Q6_K elsewhere; routers and 1-D tensors F32 (as llama.cpp's Q4_K_M mixes)."""
    if len(shape) < 2 or ".ffn_gate_inp." in name:
        return "F32"
    return "Q4_K" if ".attn_" in name else "Q6_K"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf")


@pytest.mark.parametrize(
    ("family", "types"),
    [("llama", Q8_0), ("mistral", uniform("Q4_0")), ("qwen2", mixed), ("qwen3", mixed), ("qwen3moe", mixed)],
)
def test_layers_dequantize_bit_exactly_to_transformers_gguf_loader(folder: Path, family: str, types: object) -> None:
    written = write_tiny_gguf(folder / f"{family}.gguf", family, types)  # type: ignore[arg-type]
    checkpoint = qscheme.load_checkpoint(written.path)
    reference = reference_state(written.path)
    compared = 0
    for name, layer in checkpoint.items():
        expected = reference.get(f"{name}.weight")
        if expected is None:  # one expert: a slice of transformers' stacked gate_up_proj / down_proj
            experts, _, rest = name.rpartition(".experts.")
            index, _, projection = rest.partition(".")
            stacked = reference[f"{experts}.experts.{'down_proj' if projection == 'down_proj' else 'gate_up_proj'}"]
            expected = stacked[int(index)]
            half = expected.shape[0] // 2
            expected = {"gate_proj": expected[:half], "up_proj": expected[half:]}.get(projection, expected)
        assert torch.equal(layer.dequantize(), expected), name
        assert layer.scheme.name == f"gguf/{written.types[_gguf_name(checkpoint, name)]}"
        compared += 1
    assert compared == len(checkpoint) > 0
    for name, tensor in checkpoint.tensors.items():
        assert torch.equal(tensor.float(), reference[name]), name
    # every tensor the file holds is loaded: as a layer, or as a plain tensor
    layers = {name for name in checkpoint if ".experts." not in name}
    assert {f"{name}.weight" for name in layers} | set(checkpoint.tensors) <= set(reference)


def _gguf_name(checkpoint: qscheme.Checkpoint, name: str) -> str:
    """The GGUF tensor a layer reads, from its report origin ("GGUF Q4_K tensor blk.0.attn_q.weight...")."""
    row = next(layer for layer in checkpoint.report.layers if layer.name == name)
    return row.origin.split(" tensor ")[1].split(",")[0]


def test_llama_q_and_k_rows_are_reordered_and_the_others_are_not(folder: Path) -> None:
    written = write_tiny_gguf(folder / "order.gguf", "llama", Q8_0)
    checkpoint = qscheme.load_checkpoint(written.path)
    reader = gguf.GGUFReader(str(written.path))
    stored = {tensor.name: np.asarray(tensor.data) for tensor in reader.tensors}
    for module, tensor in (("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("mlp.up_proj", "ffn_up")):
        raw = stored[f"blk.0.{tensor}.weight"]
        codes = checkpoint.plan.files.get(f"model.layers.0.{module}.weight").numpy()  # the bytes the layer read
        same = np.array_equal(codes.reshape(raw.shape), raw)
        # the rows are the file's rows, moved: the same multiset of rows either way
        assert sorted(map(bytes, codes.reshape(raw.shape))) == sorted(map(bytes, raw))
        assert same == (tensor == "ffn_up"), module
    # and the model the file came from is recovered: its q rows, quantized, in transformers' order
    original = written.model.model.layers[0].self_attn.q_proj.weight.detach()
    error = (checkpoint["model.layers.0.self_attn.q_proj"].dequantize() - original).abs().max()
    assert error < 0.05 * original.abs().max()


def test_experts_are_one_layer_per_expert_reading_its_own_rows(folder: Path) -> None:
    written = write_tiny_gguf(folder / "moe.gguf", "qwen3moe", Q8_0)
    checkpoint = qscheme.load_checkpoint(written.path)
    experts = written.model.config.num_experts
    names = [name for name in checkpoint if ".mlp.experts." in name]
    assert len(names) == 2 * experts * 3
    origins = {row.name: row.origin for row in checkpoint.report.layers}
    assert origins["model.layers.1.mlp.experts.3.up_proj"] == "GGUF Q8_0 tensor blk.1.ffn_up_exps.weight, expert 3"
    assert "model.layers.0.mlp.gate.weight" in checkpoint.tensors  # the router stays F32, plain


def test_a_tied_file_has_no_lm_head_layer(folder: Path) -> None:
    written = write_tiny_gguf(folder / "tied.gguf", "qwen3", Q8_0, tie=True)
    checkpoint = qscheme.load_checkpoint(written.path)
    assert "lm_head" not in checkpoint
    assert "model.embed_tokens" in checkpoint


def test_inspect_reports_gguf_types_schemes_and_origins(folder: Path) -> None:
    from qscheme.checkpoint import inspect_checkpoint

    written = write_tiny_gguf(folder / "inspect.gguf", "qwen2", mixed)
    inspection = inspect_checkpoint(written.path)
    assert inspection.ok, inspection.problems
    assert inspection.producer == "gguf"
    rows = {row.module: row for row in inspection.modules}
    assert rows["model.layers.0.self_attn.q_proj"].scheme == "gguf/Q4_K"
    assert rows["model.layers.0.mlp.down_proj"].scheme == "gguf/Q6_K"
    assert rows["model.layers.0.mlp.down_proj"].origin == "GGUF Q6_K tensor blk.0.ffn_down.weight"
    # qwen2's q/k/v biases belong to their quantized layers, not to the plain tensors
    assert "model.layers.0.self_attn.q_proj.bias" not in inspection.plain
    assert qscheme.load_checkpoint(written.path)["model.layers.0.self_attn.q_proj"].bias is not None


# ---------------------------------------------------------------------------- errors


def test_unknown_architecture_is_refused_naming_the_key(folder: Path) -> None:
    written = write_tiny_gguf(folder / "arch.gguf", "llama", Q8_0, architecture="gpt2")
    with pytest.raises(CheckpointError) as caught:
        qscheme.load_checkpoint(written.path)
    message = str(caught.value)
    assert "arch.gguf" in message and "'general.architecture' is 'gpt2'" in message and "qwen3moe" in message


def test_a_tensor_the_name_map_cannot_place_is_refused(folder: Path) -> None:
    extra = {"blk.0.mystery.weight": np.ones((4, 256), dtype=np.float32)}
    written = write_tiny_gguf(folder / "extra.gguf", "llama", Q8_0, extra=extra)
    with pytest.raises(CheckpointError, match=r"extra\.gguf: .*name map cannot place: blk\.0\.mystery\.weight"):
        qscheme.load_checkpoint(written.path)


def test_a_type_without_a_scheme_is_refused_listing_the_supported_types(folder: Path) -> None:
    written = write_tiny_gguf(folder / "q5.gguf", "llama", Q8_0)
    schemes = ["gguf/Q4_0", "gguf/F32"]  # a catalog without Q8_0
    with pytest.raises(CheckpointError) as caught:
        qscheme.load_checkpoint(written.path, schemes=schemes)
    message = str(caught.value)
    assert "q5.gguf" in message and "Q8_0: " in message and "blk.0.attn_k.weight" in message
    assert "reads GGUF types F32, Q4_0" in message


def test_shapes_that_disagree_with_the_config_are_refused(folder: Path) -> None:
    # the header says 8 heads of 32; transformers then builds a model whose q/k shapes still
    # agree, so change the feed-forward width instead
    written = write_tiny_gguf(folder / "shape.gguf", "llama", Q8_0, metadata={"llama.feed_forward_length": 384})
    with pytest.raises(CheckpointError) as caught:
        qscheme.load_checkpoint(written.path)
    message = str(caught.value)
    assert "shape.gguf" in message and "'blk.0.ffn_up.weight' (Q8_0 [512, 256])" in message
    assert "holds as [384, 256]" in message


def test_tensor_parallelism_is_refused(folder: Path) -> None:
    written = write_tiny_gguf(folder / "tp.gguf", "llama", Q8_0)
    with pytest.raises(UsageError, match="tensor parallelism is not offered for GGUF files"):
        qscheme.load_checkpoint(written.path, tp_rank=0, tp_size=2)


def test_a_damaged_header_is_a_checkpoint_error(folder: Path) -> None:
    bad = folder / "bad.gguf"
    bad.write_bytes(b"GGUF\x09\x00\x00\x00" + bytes(32))
    with pytest.raises(CheckpointError, match=r"bad\.gguf"):
        qscheme.load_checkpoint(bad)
