"""Element formats: rounding is nearest-ties-to-even with saturation, and bit-exact with
torch's float8 casts and with compressed-tensors' fp4 rounding and MX scales."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from qscheme.errors import FormatError
from qscheme.formats import (
    E2M1_MAGNITUDES,
    ELEMENT_FORMATS,
    UnknownFormatError,
    all_codes,
    decode,
    encode,
    get_element_format,
    mx_scale_exponent,
    pack_fp4_k,
    representable_values,
    round_to_format,
    unpack_fp4_k,
)

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
ROUNDED_FORMATS = ("e2m1", "e4m3", "e5m2", "int4", "uint4", "int8", "uint8", "e8m0")


# --- brute-force reference -----------------------------------------------------------------


def _magnitude_code(values: Tensor, name: str) -> Tensor:
    """The code of |value| for representable values: ties go to the even one."""
    if name == "e2m1":
        table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)
        return (values.abs()[:, None] == table[None, :]).int().argmax(dim=1)
    if name in ("e4m3", "e5m2"):
        dtype = ELEMENT_FORMATS[name].storage_dtype
        return (values.abs().to(dtype).view(torch.uint8) & 0x7F).long()
    if name == "e8m0":
        return torch.log2(values).round().long() + 127
    return values.abs().long()  # integers: an even integer is an even code


def _nearest_by_brute_force(x: Tensor, name: str) -> Tensor:
    """Nearest representable value of each x (float64), a tie going to the even code."""
    values = representable_values(name).double()
    # Beyond the range the nearest value is the extreme one; clamping first keeps every
    # distance that can be minimal exact in float64.
    x = x.double().clamp(float(values[0]), float(values[-1]))
    distance = (x[:, None] - values[None, :]).abs()
    is_nearest = distance == distance.min(dim=1, keepdim=True).values
    assert int(is_nearest.sum(dim=1).max()) <= 2
    codes = _magnitude_code(values, name)
    even = (codes % 2 == 0)[None, :]
    # Prefer a nearest candidate with an even code; without a tie there is just one.
    score = is_nearest.int() * 2 + (is_nearest & even).int()
    return values[score.argmax(dim=1)]


def _assert_rounds_to_nearest(x: Tensor, name: str) -> None:
    got = round_to_format(x, name).double()
    expected = _nearest_by_brute_force(x, name)
    bad = got != expected
    assert not bool(bad.any()), (
        f"{name}: x={x[bad][:5].tolist()} got {got[bad][:5].tolist()} expected {expected[bad][:5].tolist()}"
    )


def _midpoints_and_neighbours(name: str) -> Tensor:
    """Every tie point between adjacent values, one float32 ulp either side, and beyond max."""
    values = representable_values(name).double()
    midpoints = ((values[1:] + values[:-1]) / 2).float()
    assert torch.equal(midpoints.double(), (values[1:] + values[:-1]) / 2)  # exact in fp32
    inf = torch.tensor(math.inf)
    points = torch.cat(
        [
            midpoints,
            torch.nextafter(midpoints, inf),
            torch.nextafter(midpoints, -inf),
            values.float(),
            values.float() * 3,
        ]
    )
    if name == "e8m0":
        points = points[points >= 0]
    return points[torch.isfinite(points)]


def _finite_floats(name: str) -> st.SearchStrategy[float]:
    fmt = ELEMENT_FORMATS[name]
    high = min(4 * fmt.max_value, FLOAT32_MAX)
    near_range = st.floats(min_value=0.0 if name == "e8m0" else -high, max_value=high, width=32)
    anywhere = st.floats(
        min_value=0.0 if name == "e8m0" else None,
        allow_nan=False,
        allow_infinity=False,
        width=32,
    )
    return st.one_of(near_range, anywhere)


# --- rounding ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ROUNDED_FORMATS)
def test_every_midpoint_rounds_to_the_even_neighbour(name: str) -> None:
    _assert_rounds_to_nearest(_midpoints_and_neighbours(name), name)


@pytest.mark.parametrize("name", ROUNDED_FORMATS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_round_to_format_is_the_nearest_value(name: str, data: st.DataObject) -> None:
    xs = data.draw(st.lists(_finite_floats(name), min_size=1, max_size=64))
    _assert_rounds_to_nearest(torch.tensor(xs, dtype=torch.float32), name)


@pytest.mark.parametrize("name", ROUNDED_FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_round_like_their_float32_value(name: str, dtype: torch.dtype) -> None:
    x = _midpoints_and_neighbours(name).to(dtype)
    x = x[torch.isfinite(x)]
    assert torch.equal(encode(x, name), encode(x.float(), name))
    _assert_rounds_to_nearest(x.float(), name)


@pytest.mark.parametrize("name", ["e2m1", "e4m3", "e5m2", "int4", "uint4", "int8", "uint8"])
def test_infinities_saturate(name: str) -> None:
    fmt = ELEMENT_FORMATS[name]
    got = round_to_format(torch.tensor([math.inf, -math.inf]), name)
    assert got.tolist() == [fmt.max_value, fmt.min_value]


def test_nan_handling() -> None:
    nan = torch.tensor([math.nan])
    assert torch.isnan(round_to_format(nan, "e4m3")).all()
    assert torch.isnan(round_to_format(nan, "e5m2")).all()
    assert encode(nan, "e8m0").tolist() == [255]
    assert torch.isnan(decode(torch.tensor([255], dtype=torch.uint8), "e8m0")).all()
    assert encode(nan, "e2m1").tolist() == [0]
    assert encode(nan, "int4").tolist() == [0]


def test_e8m0_saturates_and_rejects_negative_values() -> None:
    x = torch.tensor([0.0, 1e-45, 2.0**-127, 2.0**127, 2.0**127 * 1.75, math.inf])
    assert encode(x, "e8m0").tolist() == [0, 0, 0, 254, 254, 254]
    with pytest.raises(FormatError, match="negative"):
        encode(torch.tensor([1.0, -0.5]), "e8m0")


def test_storage_dtypes() -> None:
    x = torch.linspace(-3, 3, 7)
    for name, fmt in ELEMENT_FORMATS.items():
        sample = x.abs() if name == "e8m0" else x
        assert encode(sample, name).dtype == fmt.storage_dtype, name


# --- codes ---------------------------------------------------------------------------------


def test_all_e2m1_codes_round_trip_and_negative_zero_decodes_to_zero() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    values = decode(codes, "e2m1")
    expected = [*E2M1_MAGNITUDES, *(-m for m in E2M1_MAGNITUDES)]
    assert values.tolist() == expected
    assert not bool(torch.signbit(values[8]))  # 0x8 is +0.0, not -0.0
    roundtrip = encode(values, "e2m1")
    assert roundtrip.tolist() == [0, *range(1, 8), 0, *range(9, 16)]


def test_e2m1_sign_bit_follows_compressed_tensors() -> None:
    x = torch.tensor([-0.0, 0.0, -0.1, -0.25, -0.26, 0.1])
    assert encode(x, "e2m1").tolist() == [0, 0, 8, 8, 9, 0]


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_all_fp8_codes_round_trip(name: str) -> None:
    codes = all_codes(name)
    values = decode(codes, name)
    finite = torch.isfinite(values)
    assert int((~finite).sum()) == (2 if name == "e4m3" else 8)
    back = encode(values[finite], name).view(torch.uint8)
    assert torch.equal(back, codes.view(torch.uint8)[finite])
    from_bytes = decode(codes.view(torch.uint8), name)
    assert torch.equal(from_bytes.view(torch.int32), values.view(torch.int32))


def test_all_e8m0_bytes_round_trip() -> None:
    codes = torch.arange(255, dtype=torch.uint8)
    values = decode(codes, "e8m0")
    assert values[0].item() == 2.0**-127 and values[127].item() == 1.0
    assert torch.equal(encode(values, "e8m0"), codes)


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_matches_torch_casts_bit_for_bit(name: str, dtype: torch.dtype) -> None:
    fmt = ELEMENT_FORMATS[name]
    generator = torch.Generator().manual_seed(0)
    exponents = torch.randint(-24, 20, (4096,), generator=generator).float()
    x = (torch.randn(4096, generator=generator) * 2.0**exponents).to(dtype)
    reference = x.clamp(fmt.min_value, fmt.max_value).to(fmt.storage_dtype)
    assert torch.equal(encode(x, name).view(torch.uint8), reference.view(torch.uint8))


def test_aliases_and_unknown_names() -> None:
    assert get_element_format("fp4") is ELEMENT_FORMATS["e2m1"]
    assert get_element_format("fp8") is ELEMENT_FORMATS["e4m3"]
    assert get_element_format("e4m3fn") is ELEMENT_FORMATS["e4m3"]
    with pytest.raises(UnknownFormatError) as raised:
        get_element_format("fp5")
    assert isinstance(raised.value, KeyError) and isinstance(raised.value, ValueError)
    assert str(raised.value) == (
        "unknown element format 'fp5'; known formats: e2m1, e4m3, e5m2, e8m0, int2, int3, int4, uint4, "
        "int8, uint8, fp16, bf16, fp32, fp4, fp8, e4m3fn"
    )


def test_representable_values_refuses_wide_formats() -> None:
    with pytest.raises(FormatError, match="at most 8 bits"):
        representable_values("bf16")


# --- compressed-tensors ----------------------------------------------------------------------


def _fp4_probe_values() -> Tensor:
    generator = torch.Generator().manual_seed(1)
    ties = _midpoints_and_neighbours("e2m1")
    special = torch.tensor([0.0, -0.0, -1e-3, 1e-3, -0.25, 0.25, 6.0, -6.0, 100.0, -100.0])
    noise = torch.randn(4000, generator=generator) * 3
    x = torch.cat([ties, special, noise])
    return x[: x.numel() // 4 * 4].reshape(2, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_codes_match_compressed_tensors(dtype: torch.dtype) -> None:
    helpers = pytest.importorskip("compressed_tensors.compressors.nvfp4.helpers")
    fp4_utils = pytest.importorskip("compressed_tensors.quantization.utils.fp4_utils")
    x = _fp4_probe_values().to(dtype)
    # compressed-tensors clamps to the fp4 range before rounding.
    rounded = fp4_utils.cast_to_fp4(x.clamp(-6.0, 6.0))
    reference = helpers.pack_fp4_to_uint8(rounded)
    packed = pack_fp4_k(encode(x, "e2m1"))
    assert torch.equal(packed, reference)
    unpacked = helpers.unpack_fp4_from_uint8(reference, *x.shape, dtype=torch.float32)
    assert torch.equal(decode(unpack_fp4_k(packed, x.shape[1]), "e2m1"), unpacked)


def _absmax_probe_values(dtype: torch.dtype) -> Tensor:
    info = torch.finfo(dtype)
    low = math.floor(math.log2(info.smallest_normal)) - 4
    high = math.floor(math.log2(info.max))
    powers = torch.tensor([2.0**e for e in range(low, high)], dtype=torch.float64)
    mantissas = torch.tensor([1.0, 1.25, 1.5, 1.74, 1.75, 1.76, 1.9999])
    grid = (powers[:, None] * mantissas[None, :]).flatten().to(dtype)
    nudged = torch.nextafter(grid, torch.zeros_like(grid))
    return torch.cat([torch.zeros(1, dtype=dtype), grid, nudged]).unique()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("element", "num_bits"), [("e2m1", 4), ("e4m3", 8)])
def test_mx_scale_exponent_matches_generate_mx_scales(dtype: torch.dtype, element: str, num_bits: int) -> None:
    mxfp = pytest.importorskip("compressed_tensors.quantization.utils.mxfp_utils")
    quant_args = pytest.importorskip("compressed_tensors.quantization.quant_args")
    absmax = torch.cat([_absmax_probe_values(dtype), torch.tensor([math.inf], dtype=dtype)])
    reference = quant_args.round_to_quantized_type_dtype(
        mxfp.generate_mx_scales(absmax, num_bits), torch.uint8, cast_to_original_dtype=False
    )
    got = mx_scale_exponent(absmax, element)
    # Where the float scale underflows (float16 only) compressed-tensors stores 127 instead.
    if dtype == torch.float16:
        reference = torch.where(reference == 0, 127, reference)
    assert torch.equal(got, reference.to(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_mx_scale_exponent_matches_the_stored_mxfp4_scale(dtype: torch.dtype) -> None:
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.mx_utils import compress_mx_scale
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(
        num_bits=4,
        type="float",
        strategy="group",
        group_size=32,
        symmetric=True,
        scale_dtype=torch.uint8,
    )
    absmax = _absmax_probe_values(dtype)
    absmax = absmax[absmax < torch.finfo(dtype).max / 2]  # an overflowing scale is garbage there
    scale, _ = calculate_qparams(-absmax, absmax, args)
    assert torch.equal(mx_scale_exponent(absmax), compress_mx_scale(scale, torch.uint8))


def test_mx_scale_exponent_rejects_bad_input() -> None:
    with pytest.raises(FormatError, match="negative"):
        mx_scale_exponent(torch.tensor([-1.0]))
    with pytest.raises(FormatError, match="no MX scale rule"):
        mx_scale_exponent(torch.tensor([1.0]), "int4")
