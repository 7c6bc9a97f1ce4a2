"""Table-driven rounding (qscheme.quantize.rounding) is exactly the element formats' rounding."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from qscheme.formats import encode, representable_values
from qscheme.quantize.rounding import round_to_codes, rounding_table

FORMATS = ("e2m1", "e4m3", "e5m2", "int4", "uint4", "int8", "uint8")


def _codes(values: Tensor, element: str) -> Tensor:
    codes = encode(values, element)
    return codes if codes.dtype == torch.uint8 else codes.view(torch.uint8)


def _hard_values(element: str) -> Tensor:
    """Representable values, the midpoints between them and their float32 neighbours, zeros,
    subnormals, values beyond the range and infinities."""
    grid = representable_values(element)
    midpoints = (grid[1:] + grid[:-1]) / 2
    points = torch.cat([grid, midpoints, -midpoints])
    above = torch.nextafter(points, torch.tensor(math.inf))
    below = torch.nextafter(points, torch.tensor(-math.inf))
    extremes = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-39, -1e-39, 1e30, -1e30, math.inf, -math.inf])
    return torch.cat([points, above, below, extremes, grid * 1.5, grid * 0.9])


@pytest.mark.parametrize("element", FORMATS)
def test_table_rounding_equals_the_format_encoder_on_every_hard_value(element: str) -> None:
    values = _hard_values(element)
    table, shift = rounding_table(element)
    assert torch.equal(round_to_codes(values, table, shift), _codes(values, element))


@pytest.mark.parametrize("element", FORMATS)
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), exponent=st.integers(-12, 12), dtype=st.sampled_from(["f32", "bf16", "f16"]))
def test_table_rounding_equals_the_format_encoder_on_random_values(
    element: str, seed: int, exponent: int, dtype: str
) -> None:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(4096, generator=generator) * 2.0**exponent
    values = values.to({"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dtype])
    table, shift = rounding_table(element)
    assert torch.equal(round_to_codes(values, table, shift), _codes(values.float(), element))


def _modelopt_mxfp4_cast(values: Tensor) -> Tensor:
    """MXFP4QTensor.quantize's cast_fp4: ties toward zero, sign bit for values not above zero."""
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    sign_bit = (2 - torch.sign(values)) // 2
    order = ((values.abs().unsqueeze(-1) - bounds) > 0).sum(dim=-1)
    return (sign_bit * 8 + order).to(torch.uint8)


def test_ties_down_with_the_sign_of_every_value_not_above_zero_is_modelopts_mxfp4_cast() -> None:
    values = torch.cat([_hard_values("e2m1"), torch.linspace(-6, 6, 4801)])
    values = values[values.abs() <= 6]  # ModelOpt's scale keeps elements within range
    table, shift = rounding_table("e2m1", "down", "not-positive")
    assert torch.equal(round_to_codes(values, table, shift), _modelopt_mxfp4_cast(values))


@pytest.mark.parametrize(
    ("element", "rule", "expected"),
    [
        ("e2m1", "negative-below-zero", [0, 0, 8, 0]),  # compressed-tensors, ModelOpt NVFP4
        ("e2m1", "not-positive", [8, 8, 8, 0]),  # ModelOpt MXFP4
        ("e4m3", "keep", [0x00, 0x80, 0x80, 0x00]),  # torch casts
        ("e4m3", "positive", [0x00, 0x00, 0x80, 0x00]),  # compressed-tensors adds a zero point first
    ],
)
def test_signs_of_zero(element: str, rule: str, expected: list[int]) -> None:
    values = torch.tensor([0.0, -0.0, -1e-30, 1e-30])
    table, shift = rounding_table(element, "even", rule)
    assert round_to_codes(values, table, shift).tolist() == expected
