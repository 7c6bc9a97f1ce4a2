"""``qscheme quantize SRC.gguf DST.gguf --scheme gguf/<TYPE>``: llama.cpp's quantization of a float GGUF.

Without llama.cpp: files built with the ``gguf`` package (its writer, float tensors), quantized
by qscheme; every tensor's type and bytes are checked (Q8_0 against gguf's own bit-exact
quantizer; the others round-trip through gguf's dequantizer within the type's error), metadata
is copied with ``general.file_type`` set, and bad inputs are typed errors. With llama.cpp (the
oracle venv): a tiny Llama converted by its ``convert_hf_to_gguf.py`` and quantized by both
``llama_model_quantize`` (pure) and qscheme gives the same bytes for every tensor.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from qscheme.errors import CheckpointError, DestinationError, UsageError
from qscheme.writing.gguf_quantize import quantize_gguf

gguf = pytest.importorskip("gguf", reason="the gguf package writes the test files: pip install gguf")
from gguf import quants  # noqa: E402


def _float_gguf(path: Path, *, k: int = 256, token_dtype: type = np.float16, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tensors = {
        "token_embd.weight": rng.standard_normal((40, k)).astype(token_dtype),
        "blk.0.attn_q.weight": rng.standard_normal((64, k)).astype(np.float32),
        "blk.0.ffn_down.weight": (rng.standard_normal((32, 2 * k)) * 0.02).astype(np.float16),
        "blk.0.attn_norm.weight": np.ones(k, dtype=np.float32),
    }
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_string("qscheme.test", "kept as is")
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def _read(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    reader = gguf.GGUFReader(str(path))
    return {t.name: (t.tensor_type.name, np.array(t.data)) for t in reader.tensors}


def test_q8_0_equals_ggufs_bit_exact_quantizer_and_the_rest_is_copied(tmp_path: Path) -> None:
    tensors = _float_gguf(tmp_path / "src.gguf", k=128)
    summary = quantize_gguf(tmp_path / "src.gguf", tmp_path / "out.gguf", "gguf/Q8_0")
    out = _read(tmp_path / "out.gguf")
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight"):
        kind, data = out[name]
        assert kind == "Q8_0"
        want = quants.quantize(tensors[name].astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
        assert np.array_equal(data.view(np.uint8).reshape(want.shape), want.view(np.uint8)), name
    kind, norm = out["blk.0.attn_norm.weight"]
    assert kind == "F32" and np.array_equal(norm, tensors["blk.0.attn_norm.weight"])
    fields = gguf.GGUFReader(str(tmp_path / "out.gguf")).fields
    assert int(fields["general.file_type"].parts[-1][0]) == 7  # LLAMA_FTYPE_MOSTLY_Q8_0
    assert bytes(fields["qscheme.test"].parts[-1]).decode() == "kept as is"
    assert summary.layers_written == 3
    assert all(row.relative_error is not None and 0 < row.relative_error < 0.01 for row in summary.layers[:3])


@pytest.mark.parametrize(("scheme", "bound"), [("gguf/Q4_0", 0.12), ("gguf/Q4_K", 0.1), ("gguf/Q6_K", 0.03)])
def test_the_written_blocks_dequantize_near_the_source(tmp_path: Path, scheme: str, bound: float) -> None:
    tensors = _float_gguf(tmp_path / "src.gguf")
    quantize_gguf(tmp_path / "src.gguf", tmp_path / "out.gguf", scheme)
    kind, data = _read(tmp_path / "out.gguf")["blk.0.attn_q.weight"]
    assert kind == scheme.split("/")[1]
    restored = quants.dequantize(data.view(np.uint8), gguf.GGMLQuantizationType[kind]).reshape(64, 256)
    source = tensors["blk.0.attn_q.weight"]
    assert np.linalg.norm(restored - source) / np.linalg.norm(source) < bound


def test_bad_requests_are_typed_errors_and_write_nothing(tmp_path: Path) -> None:
    _float_gguf(tmp_path / "src.gguf")
    with pytest.raises(UsageError, match="not a GGUF type"):
        quantize_gguf(tmp_path / "src.gguf", tmp_path / "a.gguf", "compressed-tensors/W4A16")
    with pytest.raises(UsageError, match=r"one \.gguf file"):
        quantize_gguf(tmp_path / "src.gguf", tmp_path / "a", "gguf/Q4_0")
    with pytest.raises(UsageError, match="is the source"):
        quantize_gguf(tmp_path / "src.gguf", tmp_path / "src.gguf", "gguf/Q4_0", force=True)
    quantize_gguf(tmp_path / "src.gguf", tmp_path / "q.gguf", "gguf/Q4_0")
    with pytest.raises(CheckpointError, match=r"'token_embd\.weight' is Q4_0; qscheme quantizes float weights"):
        quantize_gguf(tmp_path / "q.gguf", tmp_path / "b.gguf", "gguf/Q8_0")
    with pytest.raises(DestinationError):
        quantize_gguf(tmp_path / "src.gguf", tmp_path / "q.gguf", "gguf/Q4_0")
    _float_gguf(tmp_path / "odd.gguf", k=96)
    with pytest.raises(CheckpointError, match="rows of 96 weights, not whole blocks of 256 \\(Q4_K\\)"):
        quantize_gguf(tmp_path / "odd.gguf", tmp_path / "c.gguf", "gguf/Q4_K")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd.gguf", "q.gguf", "src.gguf"]


def test_float_outputs_are_casts_rounded_to_nearest_even(tmp_path: Path) -> None:
    tensors = _float_gguf(tmp_path / "src.gguf")
    quantize_gguf(tmp_path / "src.gguf", tmp_path / "f16.gguf", "gguf/F16")
    kind, data = _read(tmp_path / "f16.gguf")["blk.0.attn_q.weight"]
    assert kind == "F16"
    want = tensors["blk.0.attn_q.weight"].astype(np.float16)  # numpy's cast: round to nearest even
    assert np.array_equal(data.view(np.uint16).reshape(want.shape), want.view(np.uint16))


@pytest.mark.subprocess
def test_the_cli_writes_a_gguf_and_reports_each_weights_error(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    _float_gguf(tmp_path / "src.gguf")
    command = [sys.executable, "-m", "qscheme.cli.main", "quantize", str(tmp_path / "src.gguf")]
    result = subprocess.run(
        [*command, str(tmp_path / "out.gguf"), "--scheme", "gguf/Q6_K", "--json"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["layers_written"] == 3 and record["scheme"] == "gguf/Q6_K"
    refused = subprocess.run(
        [*command, str(tmp_path / "x.gguf"), "--scheme", "gguf/Q6_K", "--ignore", "lm_head"],
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2 and "--ignore and --calibration do not apply" in refused.stderr


@pytest.fixture(scope="module")
def llamacpp_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama converted to a float32 GGUF by llama.cpp's convert_hf_to_gguf.py (once per module)."""
    import llamacpp_oracle as oracle

    oracle.oracle_python()
    folder = tmp_path_factory.mktemp("llamacpp-source")
    model = oracle.tiny_model("llama", folder / "hf")
    return oracle.convert_hf_to_gguf(model, folder / "f32.gguf", "f32")


@pytest.mark.oracle
@pytest.mark.parametrize("ftype", ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "IQ4_NL", "IQ4_XS"])
def test_every_tensor_equals_llama_model_quantize_bit_for_bit(
    tmp_path: Path, ftype: str, llamacpp_source: Path
) -> None:
    import llamacpp_oracle as oracle

    source = llamacpp_source
    theirs = oracle.quantize_gguf(source, tmp_path / "theirs.gguf", {"Q4_K": "Q4_K_S"}.get(ftype, ftype), pure=True)
    quantize_gguf(source, tmp_path / "ours.gguf", f"gguf/{ftype}")
    ours, want = _read(tmp_path / "ours.gguf"), _read(theirs)
    assert set(ours) == set(want)
    for name, (kind, data) in want.items():
        assert ours[name][0] == kind, name
        differ = np.flatnonzero(ours[name][1].view(np.uint8).reshape(-1) != data.view(np.uint8).reshape(-1))
        assert differ.size == 0, f"{name} ({kind}): {differ.size} bytes differ, first at {differ[:5]}"
    assert any(kind == ftype for kind, _ in want.values())
