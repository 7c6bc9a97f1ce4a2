"""A compressed-tensors / ModelOpt folder -> GGUF (qscheme.writing.gguf_export).

Oracles: the GGUF files gguf-py writes (``gguf_tiny``: llama.cpp's names and q/k row order, written
independently of the code under test), whose tensors a round trip GGUF -> folder -> GGUF must give
back byte for byte; transformers' GGUF tokenizer reader; and llama.cpp itself (the oracle venv),
whose logits on the exported file must equal its logits on the file it came from.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf_tiny import uniform, write_tiny_gguf  # noqa: E402

import qscheme  # noqa: E402
from qscheme.cli.main import main  # noqa: E402
from qscheme.storage import read_gguf_header, read_gguf_tensor  # noqa: E402
from qscheme.writing.convert_layer import RequantizationRefusedError  # noqa: E402
from qscheme.writing.gguf_convert import convert_gguf  # noqa: E402
from qscheme.writing.gguf_export import export_gguf  # noqa: E402
from qscheme.writing.gguf_export_metadata import MissingTokenizerError  # noqa: E402
from qscheme.writing.gguf_export_names import UnsupportedArchitectureError  # noqa: E402

PAIRS = {
    "Q4_0": "compressed-tensors/W4A16_G32",
    "Q8_0": "compressed-tensors/W8A16_G32",
    "MXFP4": "compressed-tensors/MXFP4A16",
    "NVFP4": "modelopt/W4A16_NVFP4",
}


def _loader_keys(architecture: str) -> list[str]:
    """The metadata keys transformers' GGUF reader (and so qscheme's loader) takes the config from."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    from qscheme.checkpoint.gguf_names import EXPERT_WIDTHS

    model_type = {"qwen3moe": "qwen3_moe"}.get(architecture, architecture)
    table = GGUF_CONFIG_MAPPING[model_type]
    keys = [f"{architecture}.{key}" for key, attribute in table.items() if attribute is not None]
    return ["general.architecture", *keys, *(f"{architecture}.{key}" for key in EXPERT_WIDTHS)]


def _embedding_f32(kind: str):  # type: ignore[no-untyped-def]
    """Every weight in ``kind`` except the token embedding (a folder holds it as floats, so the
    round trip gives F32 back, not the GGUF's quantized embedding)."""
    return lambda name, shape: "F32" if name.startswith("token_embd") else uniform(kind)(name, shape)


def _round_trip(tmp_path: Path, family: str, kind: str) -> tuple[Path, Path, Path]:
    tiny = write_tiny_gguf(tmp_path / "source.gguf", family, _embedding_f32(kind))
    folder = tmp_path / "folder"
    convert_gguf(tiny.path, folder, PAIRS[kind])
    exported = tmp_path / "exported.gguf"
    summary = export_gguf(folder, exported, f"gguf/{kind}", without_tokenizer=True)
    written = [row for row in summary.layers if row.action != "copied"]
    assert written and all(row.action == "converted" and row.max_ulps == 0 for row in written)
    return tiny.path, folder, exported


@pytest.mark.parametrize(
    ("family", "kind"),
    [("llama", "Q4_0"), ("mistral", "Q8_0"), ("qwen2", "MXFP4"), ("qwen3", "NVFP4"), ("qwen3moe", "Q4_0")],
)
def test_round_trip_gives_the_source_tensors_byte_for_byte(tmp_path: Path, family: str, kind: str) -> None:
    source, _, exported = _round_trip(tmp_path, family, kind)
    original, written = read_gguf_header(source), read_gguf_header(exported)
    assert set(written.tensors) == set(original.tensors)
    for name, info in original.tensors.items():
        back = written.tensors[name]
        assert (back.type, back.shape) == (info.type, info.shape), name
        assert torch.equal(read_gguf_tensor(written, name), read_gguf_tensor(original, name)), name
    architecture = original.metadata["general.architecture"]
    for key in _loader_keys(architecture):
        assert written.metadata.get(key) == original.metadata.get(key), key
        if key in original.metadata:
            assert written.metadata_types[key] == original.metadata_types[key], key
    assert written.metadata["general.quantization_version"] == 2
    if family == "mistral":  # transformers reads a llama file as Mistral by its name
        assert "mistral" in written.metadata["general.name"]
    if kind in ("Q4_0", "Q8_0"):
        assert written.metadata["general.file_type"] == {"Q4_0": 2, "Q8_0": 7}[kind]  # llama_ftype


def test_the_exported_file_loads_as_the_folder(tmp_path: Path) -> None:
    _, folder, exported = _round_trip(tmp_path, "qwen2", "Q8_0")  # q/k/v biases, tied: no
    from_folder, from_file = qscheme.load_checkpoint(folder), qscheme.load_checkpoint(exported)
    assert set(from_file) == set(from_folder)
    for module, layer in from_folder.items():
        assert torch.equal(from_file[module].dequantize(), layer.dequantize()), module
        if layer.bias is not None:
            assert torch.equal(from_file[module].bias, layer.bias), module
    assert set(from_file.tensors) == set(from_folder.tensors)
    for name, value in from_folder.tensors.items():
        assert torch.equal(from_file.tensors[name], value), name


def test_cli_writes_a_gguf_and_the_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiny = write_tiny_gguf(tmp_path / "source.gguf", "llama", _embedding_f32("Q4_0"))
    folder = tmp_path / "folder"
    assert main(["convert", str(tiny.path), str(folder), "--scheme", PAIRS["Q4_0"]]) == 0
    out = tmp_path / "out.gguf"
    capsys.readouterr()
    assert main(["convert", str(folder), str(out), "--scheme", "gguf/Q4_0", "--without-tokenizer", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    rows = {row["name"]: row for row in summary["layers"]}
    assert rows["model.layers.0.self_attn.q_proj"]["action"] == "converted"
    assert rows["model.layers.0.self_attn.q_proj"]["max_ulps"] == 0
    assert rows["model.embed_tokens"]["action"] == "copied"
    assert read_gguf_header(out).tensors["blk.0.attn_q.weight"].type.name == "Q4_0"


# --- the tokenizer --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quantized_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama with a local BPE tokenizer, quantized by qscheme to W4A16_G32 (tokenizer copied)."""
    from llamacpp_oracle import tiny_model

    base = tmp_path_factory.mktemp("tokenizer")
    model = tiny_model("llama", base / "float")
    folder = base / "quantized"
    qscheme.quantize_checkpoint(model, folder, PAIRS["Q4_0"])
    return folder


def test_tokenizer_is_written_as_transformers_reads_it_back(quantized_folder: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    out = tmp_path / "model.gguf"
    export_gguf(quantized_folder, out, "gguf/Q4_0", allow_requantize=True)  # qscheme's float32 scales: not fp16
    metadata = read_gguf_header(out).metadata
    original = AutoTokenizer.from_pretrained(quantized_folder)
    assert metadata["tokenizer.ggml.model"] == "gpt2"
    vocabulary = original.get_vocab()
    assert metadata["tokenizer.ggml.tokens"] == sorted(vocabulary, key=vocabulary.__getitem__)
    assert metadata["tokenizer.ggml.eos_token_id"] == original.eos_token_id
    assert len(metadata["tokenizer.ggml.merges"]) > 0
    reread = AutoTokenizer.from_pretrained(str(out.parent), gguf_file=out.name)
    text = "The quick brown fox, 42 zebras!"
    assert reread(text)["input_ids"][-8:] == original(text)["input_ids"][-8:]


def test_a_tokenizer_larger_than_the_embedding_is_refused(quantized_folder: Path, tmp_path: Path) -> None:
    tiny = write_tiny_gguf(tmp_path / "source.gguf", "llama", _embedding_f32("Q4_0"))  # 64 tokens
    folder = tmp_path / "folder"
    convert_gguf(tiny.path, folder, PAIRS["Q4_0"])
    shutil.copy(quantized_folder / "tokenizer.json", folder)  # 320 tokens
    with pytest.raises(qscheme.CheckpointError, match="320 tokens but the embedding only 64 rows"):
        export_gguf(folder, tmp_path / "out.gguf", "gguf/Q4_0", allow_requantize=True)


# --- refusals ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder_without_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("refusals")
    tiny = write_tiny_gguf(base / "source.gguf", "llama", _embedding_f32("Q4_0"))
    convert_gguf(tiny.path, base / "folder", PAIRS["Q4_0"])
    return base / "folder"


def test_codes_not_shared_are_refused_unless_requantize(folder_without_tokenizer: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.gguf"
    with pytest.raises(RequantizationRefusedError) as error:
        export_gguf(folder_without_tokenizer, out, "gguf/Q8_0", without_tokenizer=True)
    message = str(error.value)
    assert "weight element format: int8 -> int4" in message and "--allow-requantize" in message
    assert not out.exists() and list(tmp_path.iterdir()) == []
    summary = export_gguf(folder_without_tokenizer, out, "gguf/Q8_0", without_tokenizer=True, allow_requantize=True)
    rows = [row for row in summary.layers if row.action != "copied"]
    assert rows and all(row.action == "requantized" and 0 < row.relative_error < 0.05 for row in rows)
    assert read_gguf_header(out).tensors["blk.0.ffn_up.weight"].type.name == "Q8_0"


def test_a_folder_without_tokenizer_is_refused(folder_without_tokenizer: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.gguf"
    with pytest.raises(MissingTokenizerError, match=r"no tokenizer.*--without-tokenizer"):
        export_gguf(folder_without_tokenizer, out, "gguf/Q4_0")
    assert not out.exists()
    assert main(["convert", str(folder_without_tokenizer), str(out), "--scheme", "gguf/Q4_0"]) == 2


def test_an_unsupported_architecture_is_refused(folder_without_tokenizer: Path, tmp_path: Path) -> None:
    folder = tmp_path / "folder"
    shutil.copytree(folder_without_tokenizer, folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "gpt_neox"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="'gpt_neox' has no GGUF export; supported: llama"):
        export_gguf(folder, tmp_path / "out.gguf", "gguf/Q4_0", without_tokenizer=True)


def test_a_target_that_is_no_gguf_type_is_a_usage_error(
    folder_without_tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(qscheme.UsageError, match="gguf/<TYPE>"):
        export_gguf(folder_without_tokenizer, tmp_path / "out.gguf", PAIRS["Q4_0"], without_tokenizer=True)
    capsys.readouterr()
    arguments = ["convert", str(folder_without_tokenizer), str(tmp_path / "out"), "--to", "x", "--without-tokenizer"]
    assert main(arguments) == 2
    assert "--without-tokenizer applies to a .gguf DST only" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# --- llama.cpp ----------------------------------------------------------------------------------


@pytest.mark.oracle
def test_llamacpp_gives_the_same_logits_on_the_exported_file(tmp_path: Path) -> None:
    from llamacpp_oracle import convert_hf_to_gguf, llamacpp_logits, oracle_python, quantize_gguf, tiny_model

    oracle_python()  # skips without the llama.cpp venv
    model = tiny_model("llama", tmp_path / "model")
    f32 = convert_hf_to_gguf(model, tmp_path / "f32.gguf")
    original = quantize_gguf(f32, tmp_path / "q4_0.gguf", "Q4_0", pure=True)
    folder = tmp_path / "folder"
    convert_gguf(original, folder, PAIRS["Q4_0"])
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the GGUF -> folder step writes no tokenizer
        shutil.copy(model / name, folder)
    exported = export_gguf(folder, tmp_path / "exported.gguf", "gguf/Q4_0").dst
    source, written = read_gguf_header(original), read_gguf_header(Path(exported))
    for name, info in source.tensors.items():
        if name == "token_embd.weight":  # the folder holds the embedding dequantized: F32 now, same values
            assert written.tensors[name].type.name == "F32"
            continue
        assert written.tensors[name].type == info.type, name
        assert torch.equal(read_gguf_tensor(written, name), read_gguf_tensor(source, name)), name
    tokens = np.array([0, 5, 17, 42, 100, 200, 300, 7])
    expected = llamacpp_logits(original, tokens)
    got = llamacpp_logits(exported, tokens)
    assert expected.shape == (len(tokens), 320) and np.isfinite(expected).all() and expected.std() > 0
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6, equal_nan=False)
