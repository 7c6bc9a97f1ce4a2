"""Packed blocks decode bit for bit as llama.cpp's reference dequantizers do.

The oracle is the ``gguf`` package's numpy dequantization (it mirrors ggml's C reference code):
every GGUF scheme's decode of random blocks, of several shapes and with hard values in the float
fields (zeros, subnormals, negatives, the largest fp16), equals ``gguf.quants.dequantize`` to the
bit. Both sides compute in float32 with one rounding per operation, so the comparison holds on
any CPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qscheme.catalog import load_catalog, load_scheme
from qscheme.descriptor.blocks import BlockLayout
from qscheme.errors import QuantizeError, UsageError
from qscheme.formats.blocks import ISA_CHOICES, decode_blocks

gguf = pytest.importorskip("gguf", reason="the gguf package is the oracle: pip install gguf")
from gguf import quants  # noqa: E402

GGUF_SCHEMES = sorted(s.name for s in load_catalog(include_plugins=False) if s.name.startswith("gguf/"))
HARD_FP16 = np.array([0.0, -0.0, 6.0e-8, -6.0e-8, 65504.0, -65504.0, 1.0, -2.5e-3], dtype=np.float16)


def _layout(name: str) -> BlockLayout:
    layout = load_scheme(name).weight.blocks
    assert layout is not None
    return layout


def _random_blocks(layout: BlockLayout, rows: int, blocks: int, seed: int) -> np.ndarray:
    """Random bytes with decodable float fields (finite halves, e8m0 below 255)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * blocks, layout.bytes), dtype=np.uint8)
    for field in layout.fields:
        span = slice(field.offset, field.offset + field.size)
        count = raw.shape[0] * field.count
        if field.format == "fp16":
            values = (rng.standard_normal(count) * 10.0 ** rng.integers(-6, 3, count)).astype(np.float16)
            values[: len(HARD_FP16)] = HARD_FP16[: min(len(HARD_FP16), count)]
            raw[:, span] = values.view(np.uint8).reshape(raw.shape[0], -1)
        elif field.format == "bf16":
            values = rng.standard_normal(count).astype(np.float32).view(np.uint32) >> 16
            raw[:, span] = values.astype(np.uint16).view(np.uint8).reshape(raw.shape[0], -1)
        elif field.format == "fp32":
            raw[:, span] = rng.standard_normal(count).astype(np.float32).view(np.uint8).reshape(raw.shape[0], -1)
        elif field.format == "e8m0":
            raw[:, span] = rng.integers(0, 255, size=(raw.shape[0], field.size), dtype=np.uint8)
    return raw.reshape(rows, blocks * layout.bytes)


def _oracle(name: str, raw: np.ndarray, k: int) -> np.ndarray:
    kind = gguf.GGMLQuantizationType[name.split("/", 1)[1]]
    return quants.dequantize(raw, kind).reshape(raw.shape[0], k).astype(np.float32)


def test_every_gguf_type_the_issue_names_has_a_scheme() -> None:
    wanted = "F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K IQ4_NL IQ4_XS MXFP4 NVFP4".split()
    assert {f"gguf/{name}" for name in wanted} <= set(GGUF_SCHEMES)


@pytest.mark.parametrize("name", GGUF_SCHEMES)
def test_the_block_size_is_ggmls(name: str) -> None:
    layout = _layout(name)
    elements, size = gguf.constants.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name.split("/", 1)[1]]]
    assert (layout.elements, layout.bytes) == (elements, size)


def _use_decoder(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch decoder, or the C loop (qscheme._blocks, built by the install) with its vector
    loops of one width (every width this CPU runs is tested: they must give the same bits)."""
    if name == "torch":
        monkeypatch.setenv("QSCHEME_BLOCKS_TORCH", "1")
        return
    native = pytest.importorskip("qscheme._blocks", reason="the C loop was not built (no C compiler at install)")
    if ISA_CHOICES.index(name) > ISA_CHOICES.index(native.supported_isa()):
        pytest.skip(f"this CPU does not run the {name} loops (it runs {native.supported_isa()})")
    monkeypatch.setenv("QSCHEME_BLOCKS_ISA", name)


@pytest.fixture(params=[*ISA_CHOICES, "torch"])
def decoder(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every decoder: the C loop at each vector width, and the torch one."""
    _use_decoder(str(request.param), monkeypatch)
    return str(request.param)


@pytest.mark.parametrize("name", GGUF_SCHEMES)
@pytest.mark.parametrize(("rows", "blocks", "seed"), [(1, 1, 0), (3, 2, 1), (17, 5, 2)])
def test_decode_equals_gguf_bit_for_bit(name: str, rows: int, blocks: int, seed: int, decoder: str) -> None:
    layout = _layout(name)
    raw = _random_blocks(layout, rows, blocks, seed)
    ours = decode_blocks(torch.from_numpy(raw.copy()), layout).numpy()
    want = _oracle(name, raw, blocks * layout.elements)
    assert ours.shape == want.shape
    differ = np.flatnonzero(ours.view(np.uint32) != want.view(np.uint32))
    assert differ.size == 0, f"{differ.size} weights differ, first at {differ[:4]}"


@pytest.mark.parametrize("name", GGUF_SCHEMES)
def test_decode_of_a_row_slice_equals_the_rows_of_the_whole(name: str, decoder: str) -> None:
    layout = _layout(name)
    raw = torch.from_numpy(_random_blocks(layout, 9, 2, 3).copy())
    whole = decode_blocks(raw, layout)
    assert torch.equal(decode_blocks(raw[4:7], layout).view(torch.int32), whole[4:7].view(torch.int32))


@pytest.mark.parametrize("name", ["gguf/Q4_0", "gguf/Q8_0", "gguf/Q4_1", "gguf/Q5_0", "gguf/MXFP4"])
def test_gguf_quantized_weights_decode_exactly(name: str, decoder: str) -> None:
    """Blocks written by gguf's own quantizer (real, not random, codes)."""
    layout = _layout(name)
    weights = np.random.default_rng(7).standard_normal((8, 4 * layout.elements)).astype(np.float32)
    kind = gguf.GGMLQuantizationType[name.split("/", 1)[1]]
    raw = quants.quantize(weights, kind).view(np.uint8).reshape(8, -1)
    ours = decode_blocks(torch.from_numpy(raw.copy()), layout).numpy()
    assert np.array_equal(ours.view(np.uint32), _oracle(name, raw, weights.shape[1]).view(np.uint32))
    assert np.abs(ours - weights).max() < np.abs(weights).max() / 4  # and it is a quantization of the weights


@pytest.mark.parametrize("name", ["gguf/Q4_0", "gguf/Q8_0", "gguf/Q4_K", "gguf/Q6_K", "gguf/NVFP4"])
@pytest.mark.parametrize("isa", ISA_CHOICES)
def test_large_outputs_decode_the_same_bits_at_every_width(
    name: str, isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outputs of 16 MB take the C loop's streaming stores, and a fresh output is advised onto huge
    pages; a slab of rows at an odd offset takes unaligned stores: the same bits as the torch
    decoder every way."""
    layout = _layout(name)
    raw = torch.from_numpy(_random_blocks(layout, 1024, 4096 // layout.elements, 11).copy())
    _use_decoder("torch", monkeypatch)
    want = decode_blocks(raw, layout)
    monkeypatch.delenv("QSCHEME_BLOCKS_TORCH")
    _use_decoder(isa, monkeypatch)
    assert torch.equal(decode_blocks(raw, layout).view(torch.int32), want.view(torch.int32))
    out = torch.empty(1024 * 4096 + 3)[3:].view(1024, 4096)  # not aligned to a vector
    decode_blocks(raw, layout, out=out)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))


def test_an_isa_the_cpu_lacks_or_an_unknown_one_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    native = pytest.importorskip("qscheme._blocks", reason="the C loop was not built (no C compiler at install)")
    layout = _layout("gguf/Q4_0")
    raw = torch.from_numpy(_random_blocks(layout, 1, 1, 0).copy())
    monkeypatch.setenv("QSCHEME_BLOCKS_ISA", "sse9")
    with pytest.raises(UsageError, match=r"QSCHEME_BLOCKS_ISA='sse9'.*allowed: scalar, avx2, avx512"):
        decode_blocks(raw, layout)
    if native.supported_isa() != "avx512":
        monkeypatch.setenv("QSCHEME_BLOCKS_ISA", "avx512")
        with pytest.raises(UsageError, match=f"runs at most the {native.supported_isa()} loops"):
            decode_blocks(raw, layout)


def test_decode_refuses_bytes_that_are_not_whole_blocks() -> None:
    layout = _layout("gguf/Q4_K")
    with pytest.raises(QuantizeError, match="multiple of 144"):
        decode_blocks(torch.zeros((2, 150), dtype=torch.uint8), layout)


def test_a_nan_scale_is_refused_naming_row_block_and_field() -> None:
    from qscheme.modules import QuantLinear

    layout = _layout("gguf/Q4_0")
    raw = _random_blocks(layout, 4, 3, 0)
    raw.reshape(-1, layout.bytes)[7, 0:2] = np.array([np.nan], dtype=np.float16).view(np.uint8)
    with pytest.raises(QuantizeError, match=r"row 2 block 1: field 'd' is nan"):
        QuantLinear.from_tensors("gguf/Q4_0", {"weight": torch.from_numpy(raw)})


def test_an_e8m0_byte_of_255_is_refused() -> None:
    from qscheme.modules import QuantLinear

    layout = _layout("gguf/MXFP4")
    raw = _random_blocks(layout, 2, 2, 0)
    raw[1, layout.bytes] = 255  # row 1, block 1, field e
    with pytest.raises(QuantizeError, match=r"row 1 block 1: field 'e' .*exponent byte of 0 to 254"):
        QuantLinear.from_tensors("gguf/MXFP4", {"weight": torch.from_numpy(raw)})


@pytest.mark.parametrize("name", ["gguf/Q4_K", "gguf/Q6_K", "gguf/IQ4_NL", "gguf/NVFP4", "gguf/BF16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_quant_linear_runs_the_exact_weights(name: str, dtype: torch.dtype) -> None:
    from qscheme.modules import QuantLinear

    layout = _layout(name)
    raw = _random_blocks(layout, 24, 512 // layout.elements if layout.elements > 1 else 512, 5)
    k = raw.shape[1] // layout.bytes * layout.elements
    layer = QuantLinear.from_tensors(
        name, {"weight": torch.from_numpy(raw)}, activation_dtype=dtype, kernel="reference"
    )
    assert layer.kernel.name == "reference"
    x = torch.randn(3, k).to(dtype)
    dense = torch.from_numpy(_oracle(name, raw, k))  # the reference kernel multiplies in float32
    want = torch.nn.functional.linear(x.to(torch.float32), dense).to(dtype)
    got = layer(x)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)


def test_the_install_built_the_c_loop() -> None:
    """scripts/install.sh builds qscheme._blocks (setup.py; optional only where no C compiler exists)."""
    import shutil

    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine: the torch decoder is used")
    import qscheme._blocks  # noqa: F401  # type: ignore[import-not-found]


def test_decode_into_out_writes_there_and_refuses_a_wrong_buffer() -> None:
    layout = _layout("gguf/Q4_0")
    raw = torch.from_numpy(_random_blocks(layout, 4, 2, 9).copy())
    out = torch.full((4, 64), 7.0)
    assert decode_blocks(raw, layout, out=out) is out
    assert torch.equal(out, decode_blocks(raw, layout))
    with pytest.raises(QuantizeError, match="out= must be a contiguous float32"):
        decode_blocks(raw, layout, out=torch.empty(4, 63))
