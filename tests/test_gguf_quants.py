"""qscheme.producers.gguf.quants writes llama.cpp's bytes: byte equality with llama.cpp's own C
quantizer (tests/llamacpp_oracle.py, the oracle marker) and, where gguf-py's numpy quantizer is
bit-exact, with it (no build needed); C's float32 rules (c_float) checked against numpy float32
scalars; refusals checked by message.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from qscheme.errors import QSchemeError, QuantizeError
from qscheme.producers.gguf.quants import c_float, fp4, nonlinear, quantize_blocks, supported_types
from qscheme.producers.gguf.quants.table import QUANTIZERS

REQUIRED = ("Q8_0", "Q4_0", "Q4_K", "Q6_K")
# gguf-py's numpy quantizers that are bit-exact with ggml's on every block (checked on all cases).
GGUF_EXACT_EVERYWHERE = ("Q8_0", "MXFP4")
# Bit-exact except on an all-zero block, where gguf-py writes d = +0.0 and ggml -0.0 (max / -8).
GGUF_EXACT_WITHOUT_ZERO_BLOCKS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1")


def hard_rows(columns: int, rng: np.random.Generator) -> Iterator[tuple[str, np.ndarray]]:
    """Rows that reach the quantizers' edge branches, each case [rows, columns] float32."""
    normal = rng.standard_normal((4, columns)).astype(np.float32)
    yield "zeros", np.zeros((2, columns), np.float32)
    yield "negative zeros", -np.zeros((2, columns), np.float32)
    spike = normal.copy()
    spike[:, 3] = 1e4
    spike[:, columns // 2 + 7] = -3e3
    yield "one huge value per block", spike
    yield "constant", np.full((2, columns), 0.37, np.float32)
    yield "negative constant", np.full((2, columns), -1.5, np.float32)
    yield "negative only", -np.abs(normal)
    yield "positive only", np.abs(normal)
    yield "halves (rounding ties)", (rng.integers(-16, 17, (4, columns)) / 2).astype(np.float32)
    yield "eighths (rounding ties)", (rng.integers(-64, 64, (4, columns)) / 8).astype(np.float32)
    yield "denormal-sized", (normal * np.float32(1e-40)).astype(np.float32)
    yield "tiny", (normal * np.float32(1e-20)).astype(np.float32)
    yield "mostly zero", (normal * (rng.random((4, columns)) < 0.1)).astype(np.float32)
    yield (
        "powers of two",
        (2.0 ** rng.integers(-10, 10, (4, columns)) * rng.choice([-1, 1], (4, columns))).astype(np.float32),
    )
    yield "heavy tails", rng.standard_t(2, (4, columns)).astype(np.float32)
    yield "large", (normal * np.float32(3e4)).astype(np.float32)


def normal_rows(rows: int, columns: int, scale: float, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, columns)) * scale).astype(np.float32)


def all_cases(columns: int) -> np.ndarray:
    """Every hard case and random normal rows of several scales, stacked: one oracle call per K."""
    rng = np.random.default_rng(columns)
    parts = [case for _, case in hard_rows(columns, rng)]
    parts += [
        normal_rows(rows, columns, scale, seed) for seed, (rows, scale) in enumerate([(1, 1.0), (7, 0.02), (16, 5.0)])
    ]
    return np.concatenate(parts)


def quantize(values: np.ndarray, type_name: str) -> np.ndarray:
    return quantize_blocks(torch.from_numpy(values), type_name).numpy()


def first_difference(expected: np.ndarray, actual: np.ndarray, block_bytes: int) -> str:
    if expected.shape != actual.shape:
        return f"shapes {expected.shape} vs {actual.shape}"
    blocks_expected = expected.reshape(-1, block_bytes)
    blocks_actual = actual.reshape(-1, block_bytes)
    differing = np.nonzero((blocks_expected != blocks_actual).any(axis=1))[0]
    if len(differing) == 0:
        return "equal"
    block = differing[0]
    return f"{len(differing)} of {len(blocks_expected)} blocks differ; first block {block}: bytes " + str(
        np.nonzero(blocks_expected[block] != blocks_actual[block])[0][:12].tolist()
    )


def test_required_types_are_supported() -> None:
    assert set(REQUIRED) <= set(supported_types())
    assert supported_types() == tuple(QUANTIZERS)


def test_block_shapes_are_ggml_s() -> None:
    constants = pytest.importorskip("gguf.constants")
    for name, quantizer in QUANTIZERS.items():
        expected = constants.GGML_QUANT_SIZES[constants.GGMLQuantizationType[name]]
        assert (quantizer.block_elements, quantizer.block_bytes) == expected, name


@pytest.mark.parametrize("type_name", sorted(QUANTIZERS))
def test_output_shape_and_empty_rows(type_name: str) -> None:
    quantizer = QUANTIZERS[type_name]
    columns = 2 * 256
    packed = quantize_blocks(torch.randn(3, columns), type_name)
    assert packed.dtype == torch.uint8
    assert tuple(packed.shape) == (3, columns // quantizer.block_elements * quantizer.block_bytes)
    assert tuple(quantize_blocks(torch.zeros(0, columns), type_name).shape) == (0, packed.shape[1])


@pytest.mark.parametrize("type_name", GGUF_EXACT_EVERYWHERE + GGUF_EXACT_WITHOUT_ZERO_BLOCKS)
@pytest.mark.parametrize("columns", [256, 512, 4096])
def test_matches_gguf_numpy_quantizer(type_name: str, columns: int) -> None:
    gguf_quants = pytest.importorskip("gguf.quants")
    constants = pytest.importorskip("gguf.constants")
    if type_name in GGUF_EXACT_EVERYWHERE:
        values = all_cases(columns)
    else:
        values = np.concatenate(
            [normal_rows(rows, columns, scale, rows) for rows, scale in [(1, 1.0), (9, 0.01), (64, 7.0)]]
        )
    with np.errstate(all="ignore"):
        expected = gguf_quants.quantize(values, constants.GGMLQuantizationType[type_name])
    actual = quantize(values, type_name)
    block_bytes = QUANTIZERS[type_name].block_bytes
    assert np.array_equal(expected.reshape(actual.shape), actual), first_difference(
        expected.reshape(actual.shape), actual, block_bytes
    )


@pytest.mark.oracle
@pytest.mark.parametrize("type_name", sorted(QUANTIZERS))
def test_matches_llamacpp(type_name: str) -> None:
    from llamacpp_oracle import ggml_quantize

    block_bytes = QUANTIZERS[type_name].block_bytes
    for columns in (256, 512, 4096):
        values = all_cases(columns)
        expected = ggml_quantize(values, type_name)
        actual = quantize(values, type_name)
        assert np.array_equal(expected, actual), f"K={columns}: " + first_difference(expected, actual, block_bytes)


def extreme_rows(columns: int) -> np.ndarray:
    """Rows from 1e4 to float32's limit, where the searches' sums overflow to inf and NaN (a NaN
    scale never wins C's ``if (v > max)``), and rows of 1e-45 to 1e-30, subnormal or nearly."""
    rng = np.random.default_rng(11)
    huge = rng.standard_normal((48, columns)) * 10.0 ** rng.uniform(4, 38.5, (48, 1))
    minute = rng.standard_normal((16, columns)) * 10.0 ** rng.uniform(-45, -30, (16, 1))
    return np.concatenate([np.clip(huge, -3.4e38, 3.4e38), minute]).astype(np.float32)


def below_powers_of_two_rows(columns: int) -> np.ndarray:
    """One row per power of two 2**k (k = -126..127): its largest magnitude 2**k or one of the
    floats just below it (log2f rounds those up to k: MXFP4's exponent), the rest a fraction of it."""
    rng = np.random.default_rng(12)
    rows = []
    for k in range(-126, 128):
        below = int(rng.choice([0, 1, 2, 40]))
        top = np.array(np.float32(2.0**k).view(np.uint32) - below, np.uint32).view(np.float32)
        row = rng.uniform(-1, 1, columns) * top
        row[rng.integers(columns)] = top * rng.choice([-1, 1])
        rows.append(row)
    return np.stack(rows).astype(np.float32)


def grid_tie_rows(columns: int, levels: tuple[int, ...]) -> np.ndarray:
    """Weights on a level grid and on the midpoints between its levels, times powers of two."""
    grid = np.array(sorted(set(levels)), np.float64)
    points = np.concatenate([grid, (grid[1:] + grid[:-1]) / 2])
    rng = np.random.default_rng(13)
    return np.stack([rng.choice(points, columns) * 2.0**k for k in range(-20, 20)]).astype(np.float32)


@pytest.mark.oracle
@pytest.mark.parametrize("type_name", sorted(QUANTIZERS))
def test_matches_llamacpp_on_extreme_magnitudes(type_name: str) -> None:
    from llamacpp_oracle import ggml_quantize

    values = np.concatenate([extreme_rows(256), below_powers_of_two_rows(256)])
    expected = ggml_quantize(values, type_name)
    actual = quantize(values, type_name)
    assert np.array_equal(expected, actual), first_difference(expected, actual, QUANTIZERS[type_name].block_bytes)


@pytest.mark.oracle
@pytest.mark.parametrize(
    ("type_name", "levels"),
    [
        ("IQ4_NL", nonlinear.IQ4_NL_LEVELS),
        ("IQ4_XS", nonlinear.IQ4_NL_LEVELS),
        ("MXFP4", fp4.FP4_DOUBLED_VALUES),
        ("NVFP4", fp4.FP4_DOUBLED_VALUES),
    ],
)
def test_matches_llamacpp_on_level_grid_ties(type_name: str, levels: tuple[int, ...]) -> None:
    from llamacpp_oracle import ggml_quantize

    values = grid_tie_rows(256, levels)
    expected = ggml_quantize(values, type_name)
    actual = quantize(values, type_name)
    assert np.array_equal(expected, actual), first_difference(expected, actual, QUANTIZERS[type_name].block_bytes)


def sqrt_regression_rows() -> np.ndarray:
    """Rows where a sub-block's ``sqrtf(sum_x2 / 32)`` (Q4_K's weights) is where torch's float32 CPU
    sqrt is one unit in the last place off: with it, Q4_K's search picked another scale there
    (found on a tiny llama's ffn_gate; these two rows of normal weights reproduce it)."""
    values = normal_rows(16384, 256, 0.02, 3)
    return values[[1121, 12390]]


@pytest.mark.oracle
@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K"])
def test_matches_llamacpp_where_sqrt_rounding_matters(type_name: str) -> None:
    from llamacpp_oracle import ggml_quantize

    values = sqrt_regression_rows()
    expected = ggml_quantize(values, type_name)
    actual = quantize(values, type_name)
    assert np.array_equal(expected, actual), first_difference(expected, actual, QUANTIZERS[type_name].block_bytes)


# Relative RMS error bounds for normal weights, loose (about 2x what each type reaches).
ERROR_BOUNDS = {"Q8_0": 0.01, "Q6_K": 0.03, "Q5_K": 0.06, "Q5_0": 0.08, "Q5_1": 0.08, "Q4_K": 0.12}
ERROR_BOUNDS |= {"Q4_0": 0.16, "Q4_1": 0.16, "Q3_K": 0.3, "Q2_K": 0.5}
ERROR_BOUNDS |= {"IQ4_NL": 0.16, "IQ4_XS": 0.16, "MXFP4": 0.24, "NVFP4": 0.2}


@pytest.mark.parametrize(("type_name", "bound"), sorted(ERROR_BOUNDS.items()))
def test_dequantized_bytes_are_close_to_the_weights(type_name: str, bound: float) -> None:
    """A check that needs no oracle: the bytes decode (gguf-py's dequantizer) to the weights."""
    gguf_quants = pytest.importorskip("gguf.quants")
    constants = pytest.importorskip("gguf.constants")
    values = normal_rows(8, 1024, 0.05, 11)
    raw = quantize(values, type_name)
    decoded = gguf_quants.dequantize(raw, constants.GGMLQuantizationType[type_name]).reshape(values.shape)
    relative_rms = float(np.sqrt(np.mean((decoded - values) ** 2) / np.mean(values**2)))
    assert relative_rms < bound


def test_k_not_a_multiple_of_the_block_is_refused() -> None:
    with pytest.raises(QuantizeError) as caught:
        quantize_blocks(torch.zeros(2, 320), "Q4_K", tensor_name="blk.0.attn_q.weight")
    message = str(caught.value)
    assert "blk.0.attn_q.weight" in message and "Q4_K" in message and "256" in message and "K = 320" in message


def test_non_finite_weight_is_refused_naming_the_row() -> None:
    weights = torch.zeros(5, 64)
    weights[3, 10] = float("nan")
    with pytest.raises(QuantizeError) as caught:
        quantize_blocks(weights, "Q8_0")
    assert "row 3" in str(caught.value) and "column 10" in str(caught.value)
    weights[3, 10] = float("-inf")
    with pytest.raises(QuantizeError, match="row 3"):
        quantize_blocks(weights, "Q4_0")


def test_unknown_type_lists_the_supported_ones() -> None:
    with pytest.raises(QuantizeError) as caught:
        quantize_blocks(torch.zeros(1, 256), "Q4_X")
    assert "'Q4_X'" in str(caught.value)
    for name in supported_types():
        assert name in str(caught.value)


@pytest.mark.parametrize(
    "weights",
    [torch.zeros(2, 256, dtype=torch.float16), torch.zeros(256), torch.zeros(1, 2, 256)],
    ids=["float16", "1-D", "3-D"],
)
def test_not_float32_rows_is_refused(weights: torch.Tensor) -> None:
    with pytest.raises(QuantizeError, match="float32 tensor \\[rows, K\\]"):
        quantize_blocks(weights, "Q8_0")
    assert issubclass(QuantizeError, QSchemeError)


# C's float32 rules, each against numpy float32 scalars (numpy's scalar arithmetic is C's).


def test_sequential_sum_adds_in_element_order() -> None:
    terms = np.random.default_rng(3).standard_normal((32, 50)).astype(np.float32) * np.float32(1e3)
    terms[5] = np.float32(1e8)  # order matters: small terms after a huge one are absorbed
    expected = np.zeros(50, np.float32)
    for row in terms:
        expected = (expected + row).astype(np.float32)
    assert np.array_equal(c_float.sequential_sum(torch.from_numpy(terms)).numpy(), expected)


def test_nearest_int_rounds_half_to_even_and_nearest_level_agrees() -> None:
    values = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 0.49999997, 3.2, -7.7, 4194303.0], dtype=torch.float32)
    assert c_float.nearest_int(values).tolist() == [0, 2, 2, 0, -2, 0, 3, -8, 4194303]
    assert c_float.nearest_level(values, -8, 15).tolist() == [0.0, 2.0, 2.0, 0.0, -2.0, 0.0, 3.0, -8.0, 15.0]
    huge = torch.tensor([-5e6, float("inf")], dtype=torch.float32)
    # Beyond 2**22 the bit trick is not rounding; nearest_level then gives the trick's result too.
    assert c_float.nearest_level(huge, 0, 31).tolist() == c_float.nearest_int(huge).clamp(0, 31).float().tolist()


def test_round_half_away_is_c_roundf() -> None:
    values = torch.tensor([0.5, 1.5, 2.5, -2.5, 0.49999997, -0.49999997, 126.5], dtype=torch.float32)
    assert c_float.round_half_away(values).tolist() == [1.0, 2.0, 3.0, -3.0, 0.0, 0.0, 127.0]


def test_square_root_is_correctly_rounded() -> None:
    rng = np.random.default_rng(5)
    values = np.concatenate(
        [
            rng.random(1_000_000, dtype=np.float32),
            (rng.random(100_000, dtype=np.float32) * np.float32(1e30)),
            np.array([0.0, -0.0, 1e-45, 0.0005453059, 3.4e38], np.float32),
        ]
    )
    expected = np.sqrt(values)  # numpy's float32 sqrt is the IEEE (correctly rounded) one, as C's sqrtf
    actual = c_float.square_root(torch.from_numpy(values)).numpy()
    assert actual.dtype == np.float32
    assert np.array_equal(expected.view(np.uint32), actual.view(np.uint32))


def best_index_int8(levels: tuple[int, ...], x: float) -> int:
    """ggml's best_index_int8, scalar, on a float32 x (binary search, the lower level on a tie)."""
    value = np.float32(x)
    if value <= levels[0]:
        return 0
    if value >= levels[-1]:
        return len(levels) - 1
    low, high = 0, len(levels) - 1
    while high - low > 1:
        middle = (low + high) // 2
        if value < levels[middle]:
            high = middle
        else:
            low = middle
    return high - 1 if value - np.float32(levels[high - 1]) < np.float32(levels[high]) - value else high


def test_nearest_level_index_is_ggml_best_index_int8() -> None:
    levels = nonlinear.IQ4_NL_LEVELS
    rng = np.random.default_rng(6)
    grid = np.array(levels, np.float32)
    midpoints = (grid[1:] + grid[:-1]) / np.float32(2)
    values = np.concatenate(
        [
            rng.uniform(-140, 130, 3000).astype(np.float32),
            grid,
            midpoints,
            np.nextafter(midpoints, np.float32(np.inf)),
            np.nextafter(midpoints, np.float32(-np.inf)),
            np.array([0.0, -0.0, 3e38, -3e38], np.float32),
        ]
    )
    actual = nonlinear.nearest_level_index(torch.from_numpy(values)).tolist()
    assert actual == [best_index_int8(levels, float(value)) for value in values]
    assert nonlinear.nearest_level_index(torch.tensor([float("nan")])).tolist() == [15]


def fp32_to_ue4m3(x: float) -> int:
    """ggml_fp32_to_ue4m3, scalar, on a float32 x."""
    value = np.float32(x)
    if not value > 0:
        return 0
    value = min(value, np.float32(448.0))
    bits = int(np.array(value, np.float32).view(np.uint32))
    exponent = ((bits >> 23) & 0xFF) - 127 + 7
    if exponent <= 0:
        mantissa = int(value * np.float32(512.0) + np.float32(0.5))
        return 0 if mantissa < 1 else min(mantissa, 7)
    if exponent >= 15:
        return 0x7E
    mantissa = ((bits >> 20) & 0x7) + ((bits >> 19) & 1)
    if mantissa > 7:
        mantissa, exponent = 0, exponent + 1
        if exponent >= 15:
            return 0x7E
    return (exponent << 3) | mantissa


def test_ue4m3_code_is_ggml_fp32_to_ue4m3() -> None:
    rng = np.random.default_rng(8)
    halves = fp4._UE4M3_HALVES.numpy()
    representable = halves[1:0x7F] * np.float32(2)
    values = np.concatenate(
        [
            (2.0 ** rng.uniform(-12, 10, 5000)).astype(np.float32),
            representable,
            np.nextafter(representable, np.float32(0)),
            np.nextafter(representable, np.float32(np.inf)),
            np.array([0.0, -0.0, -1.0, 1e-30, 448.0, 449.0, 3e38, 2.0**-9, 2.0**-10], np.float32),
        ]
    )
    actual = fp4.ue4m3_code(torch.from_numpy(values)).tolist()
    assert actual == [fp32_to_ue4m3(float(value)) for value in values]
    # Every code below 0x7E stands for its own value (the 256..448 codes all collapse to 0x7E).
    assert fp4.ue4m3_code(torch.from_numpy(representable[:0x77])).tolist() == list(range(1, 0x78))


@pytest.mark.subprocess  # ctypes.util.find_library runs ldconfig
def test_e8m0_exponent_floors_log2f() -> None:
    import ctypes.util

    library = ctypes.util.find_library("m")
    if library is None:
        pytest.skip("no C math library to call log2f from")
    log2f = ctypes.CDLL(library).log2f
    log2f.restype, log2f.argtypes = ctypes.c_float, [ctypes.c_float]
    powers = (np.float32(2.0) ** np.arange(-126, 128)).astype(np.float32)
    rng = np.random.default_rng(9)
    values = np.concatenate(
        [
            powers,
            np.nextafter(powers, np.float32(0)),
            (powers.view(np.uint32) - 3).view(np.float32),
            (2.0 ** rng.uniform(-149, 128, 20000)).astype(np.float32),
            np.array([1e-45, 1e-40], np.float32),
        ]
    )
    expected = [int(np.floor(np.float32(log2f(float(v))))) - 2 + 127 for v in values]
    actual = fp4.e8m0_exponent(torch.from_numpy(values)).tolist()
    assert actual == [e & 0xFF for e in expected]
    assert fp4.e8m0_exponent(torch.zeros(1)).tolist() == [0]


def test_e8m0_half_is_two_to_the_exponent_minus_128() -> None:
    exponents = torch.arange(0, 255, dtype=torch.int32)
    expected = [np.float32(2.0 ** (int(e) - 128)) for e in exponents]
    assert fp4.e8m0_half(exponents).tolist() == [float(v) for v in expected]


def test_divide_rounds_once() -> None:
    denominators = np.random.default_rng(4).uniform(0.1, 10.0, 10_000).astype(np.float32)
    expected = np.float32(63.0) / denominators
    assert np.array_equal(c_float.divide(63.0, torch.from_numpy(denominators)).numpy(), expected)
