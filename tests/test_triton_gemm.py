"""The Triton GEMM under the interpreter (TRITON_INTERPRET=1, set by conftest.py) against the
reference kernel and a float64 product of the exact emulation, for every built-in scheme and
for YAML-only schemes, on ragged shapes with fused partitions and 16/32-bit activations."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from qscheme_plugins.reference_kernel import ReferenceKernel
from triton_samples import assert_matches, float64_weight, reference_output, with_shared_activation_scales

from qscheme.canonical import canonicalize
from qscheme.catalog import load_catalog
from qscheme.descriptor import Scheme, parse_scheme_file, parse_scheme_text
from qscheme.errors import QuantizeError
from qscheme.formats import decode
from qscheme.quantize import quantize_weight
from qscheme.triton.configs import TileConfig
from qscheme.triton.decode import decode_e2m1_words, decode_element, decode_int4_words, decode_scale
from qscheme.triton.layout import four_bit_words
from qscheme.triton.linear import interpreted, linear, prepare_weight
from qscheme.triton.samples import random_weight
from qscheme.triton.spec import ELEMENT_IDS, SCALE_FORMAT_IDS, specialize

YAML_SCHEMES = sorted(Path(__file__).parent.joinpath("data", "triton_schemes").glob("*.yaml"))
BUILTIN = [s for s in load_catalog(include_plugins=False) if s.weight.blocks is None]  # blocks: not Triton's


def _one_per_kernel_case(schemes: list[Scheme]) -> list[Scheme]:
    """The first of the schemes the kernel sees as one case: the same compile-time specialisation and
    the same canonical weight (the file layouts differ, e.g. GPTQ's v1 and v2 twins of a
    compressed-tensors scheme; tests/test_triton_kernel_plugin.py runs every scheme's own tensors)."""
    seen: set[object] = set()
    kept = []
    for scheme in schemes:
        weight, scale = scheme.weight, scheme.weight.scale
        zero = weight.zero_point.format if weight.zero_point is not None else None
        key = (
            specialize(scheme),
            weight.format,
            (scale.granularity, scale.group_size, scale.block, scale.format),
            zero,
            weight.global_scale is not None,
        )
        if key not in seen:
            seen.add(key)
            kept.append(scheme)
    return kept


YAML: list[Scheme] = [parse_scheme_file(path) for path in YAML_SCHEMES]
SCHEMES: list[Scheme] = _one_per_kernel_case(BUILTIN) + YAML

# (label, input shape without K, dtype, bias): M=1 decode in bf16, a 3-D fp32 batch of 33
# tokens, fp16 with 5 tokens; N=200 and K=301 are not multiples of any tile or group.
CASES = [
    ("m1-bf16", (1,), torch.bfloat16, True),
    ("m33-fp32", (3, 11), torch.float32, True),
    ("m5-fp16", (5,), torch.float16, False),
]
N, K = 200, 301


def test_runs_interpreted() -> None:
    assert interpreted(), "tests/conftest.py must set TRITON_INTERPRET=1 before qscheme is imported"


def _partitions(scheme: Scheme, n: int) -> tuple[int, ...]:
    # The reference dequantization takes per-partition global scales with group or channel
    # scales only; the kernel takes them with any (one float32 multiplier per output row).
    if scheme.weight.global_scale is not None and scheme.weight.scale.granularity in ("block", "tensor"):
        return (n,)
    return (72, n - 72)


def _check(scheme: Scheme, weight, x: torch.Tensor, bias: torch.Tensor | None, config=None) -> None:  # type: ignore[no-untyped-def]
    prepared = prepare_weight(weight, "cpu")
    actual = linear(prepared, x, bias, config)
    assert_matches(actual, reference_output(weight, x, bias), x.dtype, f"{scheme.name} vs float64")
    reference = ReferenceKernel()
    expected = reference.apply(reference.prepare(weight, torch.device("cpu")), x, bias)
    # Both round once to x's dtype from float32 sums: one more unit in the last place apart.
    assert_matches(actual, expected.double(), x.dtype, f"{scheme.name} vs the reference kernel")


@pytest.mark.parametrize("label, leading, dtype, with_bias", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("scheme", SCHEMES, ids=[s.name for s in SCHEMES])
@pytest.mark.interpreter
def test_matches_reference(
    scheme: Scheme, label: str, leading: tuple[int, ...], dtype: torch.dtype, with_bias: bool
) -> None:
    generator = torch.Generator().manual_seed(7)
    weight = random_weight(scheme, N, K, partitions=_partitions(scheme, N), seed=11)
    x = torch.randn((*leading, K), generator=generator).to(dtype)
    bias = torch.randn(N, generator=generator).to(dtype) if with_bias else None
    _check(scheme, weight, x, bias)


TILED = [
    # scheme, forced tiles, M: every way a scale group meets a K tile, split-K, many tiles.
    ("compressed-tensors/NVFP4", TileConfig(16, 32, 64, split_k=2), 20),  # groups of 16 inside a tile
    ("compressed-tensors/W4A16_ASYM", TileConfig(16, 64, 64, split_k=3), 3),  # a group spans tiles
    ("compressed-tensors/FP8_BLOCK", TileConfig(16, 64, 32, split_k=2), 4),  # 128x128 blocks, per-group input
    ("test/UINT4_G48_ZP", TileConfig(16, 32, 64), 2),  # groups of 48: gathered per element
    ("modelopt/mxfp4", TileConfig(32, 32, 32), 40),  # group == tile
    ("compressed-tensors/W8A8", TileConfig(16, 128, 64, split_k=2), 70),  # per-token epilogue after split-K
    ("test/E5M2_BLOCK_E8M0", TileConfig(16, 16, 64, group_m=2), 50),  # grouped tile order, 32-row blocks
    # weights first (y^T = W x^T, K permuted within 32 columns): every scale layout and input kind
    ("compressed-tensors/NVFP4A16", TileConfig(16, 64, 128, split_k=2, weights_first=True), 1),
    ("compressed-tensors/NVFP4", TileConfig(16, 32, 64, split_k=2, weights_first=True), 20),
    ("compressed-tensors/W4A16_ASYM", TileConfig(16, 64, 64, split_k=3, weights_first=True), 3),
    ("compressed-tensors/FP8_BLOCK", TileConfig(16, 64, 32, split_k=2, weights_first=True), 4),
    ("test/UINT4_G48_ZP", TileConfig(16, 32, 64, weights_first=True), 2),
    ("modelopt/mxfp4", TileConfig(32, 32, 32, weights_first=True), 40),
    ("compressed-tensors/W8A8", TileConfig(16, 128, 64, split_k=2, weights_first=True), 70),
]


@pytest.mark.parametrize("name, config, m", TILED, ids=[f"{t[0]}-{t[1].describe()}" for t in TILED])
@pytest.mark.interpreter
def test_small_tiles(name: str, config: TileConfig, m: int) -> None:
    scheme = next(s for s in BUILTIN + YAML if s.name == name)
    n, k = 100, 333
    weight = random_weight(scheme, n, k, partitions=_partitions(scheme, n), seed=5)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3))
    _check(scheme, weight, x, torch.randn(n), config)


def _uint8_zero_point_scheme(granularity: str, packing: str) -> Scheme:
    """uint8 weights with uint8 zero points: tiled (groups of 32 or 128) or one per row."""
    group = granularity.removeprefix("group")
    columns = "1" if granularity == "channel" else f'"ceil(K/{group})"'
    scale = "granularity: channel" if granularity == "channel" else f"granularity: group, group_size: {group}"
    rows, dtype, packed = ("N", "uint8", "") if packing == "none" else ('"ceil(N/4)"', "int32", "packing: int32_n, ")
    return parse_scheme_text(
        f"""
name: test/UINT8_{granularity.upper()}_{packing.upper()}
weight:
  format: uint8
  tensor: {{name: weight, dtype: uint8, shape: [N, K]}}
  scale:
    {{{scale}, format: fp32, stored: multiplier,
     tensor: {{name: weight_scale, dtype: float32, shape: [N, {columns}]}}}}
  zero_point:
    {{format: uint8, {packed}tensor: {{name: weight_zero_point, dtype: {dtype}, shape: [{rows}, {columns}]}}}}
activation: none
"""
    )


UINT8_ZERO_POINTS = [("group32", "none"), ("group32", "int32_n"), ("group128", "none"), ("channel", "none")]


@pytest.mark.parametrize(("granularity", "packing"), UINT8_ZERO_POINTS)
def test_uint8_zero_points_above_127_from_a_checkpoint_match_float64(granularity: str, packing: str) -> None:
    # the real path: quantize_weight's tensors -> canonicalize -> both kernels, against the
    # float64 dequantization written out from the same checkpoint tensors
    scheme = _uint8_zero_point_scheme(granularity, packing)
    n, k = 24, 160
    lean = torch.where(torch.arange(n) % 2 == 0, -0.08, 0.08).reshape(n, 1)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * 0.05 + lean
    tensors = quantize_weight(w, scheme)
    weight = canonicalize(scheme, tensors)
    assert weight.zero_point is not None and int(weight.zero_point.max()) > 127
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2))
    expected = x.double() @ float64_weight(scheme, tensors, n, k).T
    actual = linear(prepare_weight(weight, "cpu"), x)
    assert_matches(actual, expected, torch.float32, f"{scheme.name}: triton vs float64")
    reference = ReferenceKernel()
    output = reference.apply(reference.prepare(weight, torch.device("cpu")), x, None)
    assert_matches(output, expected, torch.float32, f"{scheme.name}: reference vs float64")


@pytest.mark.parametrize(("granularity", "packing"), UINT8_ZERO_POINTS)
def test_uint8_zero_points_of_the_samples_cover_their_range(granularity: str, packing: str) -> None:
    scheme = _uint8_zero_point_scheme(granularity, packing)
    weight = random_weight(scheme, 40, 300, seed=3)
    assert weight.zero_point is not None
    assert (int(weight.zero_point.min()), int(weight.zero_point.max())) == (0, 255)
    x = torch.randn(2, 300, generator=torch.Generator().manual_seed(4))
    _check(scheme, weight, x, None)


def test_partitions_with_different_input_scales_quantize_the_input_per_partition() -> None:
    scheme = load_catalog(include_plugins=False).get("modelopt/NVFP4")
    weight = random_weight(scheme, 96, 128, partitions=(32, 32, 32), seed=2)
    assert len(set(weight.input_global_scale.tolist())) == 3  # type: ignore[union-attr]
    assert len(prepare_weight(weight, "cpu").segments) == 3
    _check(scheme, weight, torch.randn(4, 128), None)

    shared = with_shared_activation_scales(weight)
    assert len(prepare_weight(shared, "cpu").segments) == 1
    _check(scheme, shared, torch.randn(4, 128), None)


def test_nvfp4_input_divisor_reproduces_compressed_tensors_rounding() -> None:
    scheme = load_catalog(include_plugins=False).get("compressed-tensors/NVFP4")
    sample = random_weight(scheme, 64, 256, seed=4)
    divisor = torch.tensor([2688.0 / 3.7])
    weight = replace(sample, input_global_scale=torch.reciprocal(divisor), input_global_scale_divisor=divisor)
    prepared = prepare_weight(weight, "cpu")
    assert prepared.divisor
    x = torch.randn(6, 256) * 3
    reference = ReferenceKernel()
    expected = reference.apply(reference.prepare(weight, torch.device("cpu")), x, None)
    assert_matches(linear(prepared, x), expected.double(), torch.float32, "divisor path")


def test_empty_input_and_leading_dimensions() -> None:
    scheme = load_catalog(include_plugins=False).get("compressed-tensors/NVFP4A16")
    prepared = prepare_weight(random_weight(scheme, 32, 64), "cpu")
    assert linear(prepared, torch.zeros(0, 64)).shape == (0, 32)
    assert linear(prepared, torch.zeros(2, 0, 64, dtype=torch.bfloat16)).shape == (2, 0, 32)
    assert linear(prepared, torch.randn(64)).shape == (32,)


def test_bad_inputs_are_refused_with_the_reason() -> None:
    scheme = load_catalog(include_plugins=False).get("compressed-tensors/NVFP4A16")
    prepared = prepare_weight(random_weight(scheme, 32, 64), "cpu")
    with pytest.raises(QuantizeError, match="input has 63 features, the layer takes K=64"):
        linear(prepared, torch.randn(2, 63))
    with pytest.raises(QuantizeError, match=r"float16, bfloat16 or float32 inputs, not torch\.float64"):
        linear(prepared, torch.randn(2, 64, dtype=torch.float64))
    with pytest.raises(QuantizeError, match=r"bias has shape \(31,\), expected \[32\]"):
        linear(prepared, torch.randn(2, 64), torch.randn(31))


# --- decoders ---------------------------------------------------------------------------------


@triton.jit
def _decode_all(src, dst, FORMAT: tl.constexpr, SCALE: tl.constexpr):
    offsets = tl.arange(0, 256)
    codes = tl.load(src + offsets)
    if SCALE:
        values = decode_scale(codes, FORMAT)
    else:
        values = decode_element(codes, FORMAT)
    tl.store(dst + offsets, values)


def _decoded(codes: torch.Tensor, format_id: int, scale: bool = False) -> torch.Tensor:
    out = torch.empty(256)
    _decode_all[(1,)](codes, out, format_id, scale)
    return out


def _same_bits(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    both_nan = actual.isnan() & expected.isnan()
    return bool(((actual.view(torch.int32) == expected.view(torch.int32)) | both_nan).all())


BYTES = torch.arange(256, dtype=torch.uint8)


@pytest.mark.parametrize("element", ["e2m1", "int4", "uint4", "e4m3", "e5m2", "int8", "uint8"])
def test_element_decoders_match_the_formats_module_on_every_code(element: str) -> None:
    if element in ("e2m1", "int4", "uint4"):
        codes = BYTES & 0xF
        expected = {
            "e2m1": decode(codes, "e2m1"),
            "int4": ((codes.to(torch.int16) ^ 8) - 8).float(),
            "uint4": codes.float(),
        }[element]
    elif element == "int8":
        codes = BYTES.view(torch.int8)
        expected = codes.float()
    else:
        codes = BYTES
        expected = decode(codes, element)
    if element == "e2m1":
        expected = expected + 0.0  # code 0x8 decodes to +0.0
    assert _same_bits(_decoded(codes, ELEMENT_IDS[element]), expected)


@pytest.mark.parametrize("scale_format", ["e4m3", "e8m0"])
def test_scale_decoders_match_the_formats_module_on_every_byte(scale_format: str) -> None:
    assert _same_bits(_decoded(BYTES, SCALE_FORMAT_IDS[scale_format], scale=True), decode(BYTES, scale_format))


@triton.jit
def _decode_words(src, dst, WORDS: tl.constexpr, FORMAT: tl.constexpr):
    rows = tl.arange(0, 16)
    words = tl.load(src + rows[:, None] * WORDS + tl.arange(0, WORDS)[None, :])
    if FORMAT == 0:  # e2m1 (decode ids: 0 is float32, the interpreter's dtype)
        values = decode_e2m1_words(words, 16, WORDS, 0, False)
    else:
        values = decode_int4_words(words, 16, WORDS, FORMAT == 1, 0, False)
    tl.store(dst + rows[:, None] * (8 * WORDS) + tl.arange(0, 8 * WORDS)[None, :], values)


@pytest.mark.parametrize("element", ["e2m1", "int4", "uint4"])
def test_word_decoders_read_the_laid_out_words_in_canonical_order(element: str) -> None:
    packed = torch.randint(0, 256, (16, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed[0, :8] = torch.tensor([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE], dtype=torch.uint8)  # all 16 codes
    out = torch.empty(16, 64)
    _decode_words[(1,)](four_bit_words(packed, element), out, 8, ELEMENT_IDS[element])
    nibbles = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(16, 64)
    if element == "int4":  # two's complement nibbles
        nibbles = ((nibbles.to(torch.int8) ^ 8) - 8).to(torch.int8)
    assert torch.equal(out, decode(nibbles, element))  # -0.0 == +0.0


def _run_forced(prepared, x: torch.Tensor, constexprs: dict[str, int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The GEMM for x with some constexprs forced (the interpreter's own choice otherwise);
    a scheme that quantizes its inputs gets them from the pre-pass, decoded in x's dtype."""
    from qscheme.triton.act_quant import decoded_dtype, quantize_input
    from qscheme.triton.configs import interpreted_config
    from qscheme.triton.linear import gemm_launches

    out = torch.empty((x.shape[0], prepared.n), dtype=x.dtype)
    tile = interpreted_config(x.shape[0], prepared.n, prepared.k)
    segment = prepared.segments[0]
    inputs, x_scale, decoded = x, None, False
    if prepared.spec.A_QUANTIZED:
        dtype = decoded_dtype(prepared.spec, x.dtype)
        assert dtype is not None
        quantized = quantize_input(
            x, prepared.spec, static_scale=segment.static_scale, divisor=prepared.divisor, decoded=dtype
        )
        inputs, x_scale, decoded = quantized.codes, quantized.scale, True
    launches = gemm_launches(
        prepared, segment, inputs, x_scale, None, out, tile, x.dtype, "interpreter", decoded_input=decoded
    )
    for launch in launches:
        replace(launch, constexprs={**launch.constexprs, **constexprs}).run()
    return out


@pytest.mark.parametrize(
    "scheme_name", ["compressed-tensors/W4A16", "compressed-tensors/W4A16_ASYM", "modelopt/W4A16_AWQ"]
)
def test_int4_decoded_in_float16_equals_float32_decode_rounded_once(scheme_name: str) -> None:
    """The GPU's float16 path for int4 / uint4 weights with float16 scales decodes, subtracts
    zero points and multiplies by the scale in float16 (``decode_dtype``); each weight must come
    out as the float32 product rounded once to float16, as when decoded in float32. Run under
    the interpreter with the same float16 dot (the PTX register split aside)."""
    from qscheme.triton.gemm import DOT_FP16
    from qscheme.triton.linear import decode_dtype
    from qscheme.triton.spec import DECODE_FP16, DECODE_FP32

    scheme = next(s for s in BUILTIN if s.name == scheme_name)
    prepared = prepare_weight(random_weight(scheme, 96, 512, seed=3, scale_dtype="float16"), "cpu")
    assert prepared.scale is not None and prepared.scale.dtype == torch.float32  # widened for the load
    assert decode_dtype(prepared.spec, torch.float16, prepared.scale_dtype, True) == DECODE_FP16
    x = (torch.randn(5, 512, generator=torch.Generator().manual_seed(4))).to(torch.float16)
    half = _run_forced(prepared, x, {"W_DECODE": DECODE_FP16, "DOT_DTYPE": DOT_FP16.value})
    single = _run_forced(prepared, x, {"W_DECODE": DECODE_FP32, "DOT_DTYPE": DOT_FP16.value})
    assert torch.equal(half, single)
    assert float(half.float().abs().max()) > 0


@pytest.mark.parametrize(("scheme_name", "fold"), [("compressed-tensors/NVFP4A16", True), ("test/FP4_G64_FP16", False)])
def test_e2m1_decoded_in_float16_equals_float32_decode_rounded_once(scheme_name: str, fold: bool) -> None:
    """The GPU's float16 path for e2m1 weights: float16 bit patterns worth 2**-14 times the
    values, times an e4m3 group scale folded in (the accumulator scaled back by 2**14) or, for
    float16 group scales, times 2**14 and then the scale; the same output as decoding in
    float32 and rounding each weight once to float16. Under the interpreter, same dot."""
    from qscheme.triton.gemm import DOT_FP16
    from qscheme.triton.linear import _fold_scale, decode_dtype
    from qscheme.triton.spec import DECODE_FP16, DECODE_FP32

    scheme = next(s for s in SCHEMES if s.name == scheme_name)
    prepared = prepare_weight(random_weight(scheme, 96, 512, seed=3, scale_dtype="float16"), "cpu")
    assert decode_dtype(prepared.spec, torch.float16, prepared.scale_dtype, True) == DECODE_FP16
    assert _fold_scale(prepared.spec, torch.float16, True) == fold
    x = (torch.randn(5, 512, generator=torch.Generator().manual_seed(4))).to(torch.float16)
    forced = {"W_DECODE": DECODE_FP16, "DOT_DTYPE": DOT_FP16.value, "W_FOLD_SCALE": fold}
    half = _run_forced(prepared, x, forced)
    single = _run_forced(prepared, x, {"W_DECODE": DECODE_FP32, "DOT_DTYPE": DOT_FP16.value, "W_FOLD_SCALE": False})
    assert torch.equal(half, single)
    assert float(half.float().abs().max()) > 0


ACT_QUANTIZED = [s for s in SCHEMES if s.activation is not None]


@pytest.mark.parametrize("scheme", ACT_QUANTIZED, ids=[s.name for s in ACT_QUANTIZED])
@pytest.mark.interpreter
def test_gemm_on_decoded_inputs_equals_the_gemm_decoding_codes(scheme: Scheme) -> None:
    """Where the pre-pass hands the GEMM decoded values (``act_quant.decoded_dtype``), the
    output is bit for bit the one the GEMM gives decoding the codes itself (the path FP8 per
    group keeps, and MX with float16 inputs on a GPU)."""
    from qscheme.triton.act_quant import decoded_dtype, quantize_input
    from qscheme.triton.configs import interpreted_config
    from qscheme.triton.linear import gemm_launches

    weight = random_weight(scheme, 96, 160, seed=8)
    prepared = prepare_weight(weight, "cpu")
    spec = prepared.spec
    x = torch.randn(5, 160, generator=torch.Generator().manual_seed(9)) * 3
    segment = prepared.segments[0]
    tile = interpreted_config(5, segment.end - segment.start, 160)
    modes = [None] + ([torch.float32] if decoded_dtype(spec, torch.float32) is not None else [])
    outputs = []
    for mode in modes:
        quantized = quantize_input(
            x,
            spec,
            static_scale=segment.static_scale,
            divisor=prepared.divisor,
            pre_scale=prepared.pre_scale,
            decoded=mode,
        )
        out = torch.zeros(5, prepared.n)
        inputs, x_scale = quantized.codes, quantized.scale
        launches = gemm_launches(
            prepared,
            segment,
            inputs,
            x_scale,
            None,
            out,
            tile,
            torch.float32,
            "interpreter",
            decoded_input=quantized.decoded,
        )
        for launch in launches:
            launch.run()
        outputs.append(out)
    if (
        scheme.activation is not None
        and scheme.activation.granularity == "group"
        and scheme.activation.format == "e4m3"
    ):
        assert len(outputs) == 1  # FP8 per group: codes only
    else:
        assert len(outputs) == 2 and torch.equal(outputs[0], outputs[1])
    assert float(outputs[0][:, segment.start : segment.end].abs().max()) > 0


@pytest.mark.parametrize("weights_first", [False, True], ids=["x-wt", "weights-first"])
@pytest.mark.parametrize(
    "scheme_name", ["compressed-tensors/NVFP4A16", "compressed-tensors/W4A16_ASYM", "compressed-tensors/NVFP4"]
)
@pytest.mark.interpreter
def test_fused_split_k_reduction_gives_the_two_pass_bits(scheme_name: str, weights_first: bool) -> None:
    """QSCHEME_TRITON_SPLIT_K=fused: the last program of each output tile adds the partial sums
    in split order and applies the epilogue (bias, row and token multipliers): the same bits
    as the second kernel, and the arrival counters are back to zero afterwards."""
    from qscheme.triton import linear as lin

    scheme = next(s for s in BUILTIN if s.name == scheme_name)
    prepared = prepare_weight(random_weight(scheme, 80, 512, seed=6), "cpu")
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(80, generator=torch.Generator().manual_seed(3))
    tile = TileConfig(16, 32, 64, split_k=4, num_warps=4, num_stages=1, weights_first=weights_first)  # 3 x 4 tiles
    outputs = {}
    for mode in ("two-pass", "fused"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(lin.SPLIT_K_VARIABLE, mode)
            expected = 1 if mode == "fused" else 2  # the GEMM, and the split-K epilogue kernel
            assert all(len(_segment_launches(prepared, seg, x, bias, tile)) == expected for seg in prepared.segments)
            outputs[mode] = lin.linear(prepared, x, bias, tile)
    assert torch.equal(outputs["fused"], outputs["two-pass"])
    assert float(outputs["fused"].abs().max()) > 0
    assert all(int(c.abs().max()) == 0 for c in lin._COUNTERS.values())


def _segment_launches(prepared, segment, x, bias, tile):  # type: ignore[no-untyped-def]
    from qscheme.triton.linear import gemm_launches

    out = torch.empty((x.shape[0], prepared.n))
    return gemm_launches(prepared, segment, x, None, bias, out, tile, x.dtype, "interpreter")


def _near_zero_point_weight(scheme_name: str, n: int, k: int, scale_value: float, zero: int, scale_dtype: str):  # type: ignore[no-untyped-def]
    """A layer whose every code is its zero point z or one off, clamped to the code range (values
    -1, 0 or 1 times a huge but finite group scale), so each real weight is finite while -z
    times the scale is not."""
    scheme = next(s for s in BUILTIN if s.name == scheme_name)
    weight = random_weight(scheme, n, k, seed=1, scale_dtype=scale_dtype)
    assert weight.zero_point is not None
    offsets = torch.randint(-1, 2, (n, k), generator=torch.Generator().manual_seed(2))
    values = (zero + offsets).clamp(-8, 7)
    nibbles = (values & 0xF).to(torch.uint8)
    nibbles = torch.nn.functional.pad(nibbles, (0, k % 2))
    return replace(
        weight,
        codes=(nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).contiguous(),
        scale=torch.full_like(weight.scale, scale_value),
        zero_point=torch.full_like(weight.zero_point, zero),
    )


@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")  # the padding, before its mask
@pytest.mark.parametrize("k", [100, 200, 256])
def test_padding_past_a_ragged_k_adds_nothing_with_tiled_zero_points(k: int) -> None:
    """Codes past K are padding (0); with a zero point z they decode to -z times the last
    group's scale, which can overflow while every real weight is finite: the GEMM zeroes them
    (W_MASK_K) where K is ragged, so 0 x inf never makes a NaN. float32 here, and the GPU's
    float16 decode and dot forced under the interpreter."""
    from qscheme.triton.gemm import DOT_FP16
    from qscheme.triton.linear import mask_k
    from qscheme.triton.spec import DECODE_FP16

    weight = _near_zero_point_weight("compressed-tensors/W4A16_ASYM", 16, k, 3.0e38, -8, "float32")
    prepared = prepare_weight(weight, "cpu")
    assert mask_k(prepared.spec, k, 128) is (k % 128 != 0)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(3)) * 1e-3
    expected = reference_output(weight, x)
    assert bool(torch.isfinite(expected).all())
    assert_matches(linear(prepared, x), expected, torch.float32, f"K={k}")

    half = _near_zero_point_weight("compressed-tensors/W4A16_ASYM", 16, k, 65504.0, -8, "float16")
    prepared = prepare_weight(half, "cpu")
    x16 = (torch.randn(2, k, generator=torch.Generator().manual_seed(3)) * 1e-3).half()
    out = _run_forced(prepared, x16, {"W_DECODE": DECODE_FP16, "DOT_DTYPE": DOT_FP16.value})
    assert bool(torch.isfinite(out).all())
    assert_matches(out, reference_output(half, x16), torch.float16, f"fp16 K={k}")
