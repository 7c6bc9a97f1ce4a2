"""Which declared weight layouts let a checkpoint give back its layer size."""

from __future__ import annotations

from pathlib import Path

import pytest

from qscheme.descriptor import parse_scheme_file, parse_scheme_text
from qscheme.descriptor.loadable import exact_layout, load_problems, unfixed_sizes
from qscheme.descriptor.shapes import parse_shape

BUILTIN = Path(__file__).resolve().parents[1] / "schemes"
INT4 = """\
name: test/int4
weight:
  format: int4
  packing: {packing}
  tensor: {{name: weight_packed, dtype: {dtype}, shape: {shape}}}
  scale: {{granularity: channel, format: float, stored: multiplier, tensor: {{name: s, dtype: float32, shape: [N, 1]}}}}
{extra}"""


@pytest.mark.parametrize(
    ("shapes", "unfixed"),
    [
        ([["N", "K"]], {}),
        ([["N", "K/8"]], {}),
        ([["N", "ceil(K/8)"]], {"K": 8}),
        ([["ceil(N/2)", "K"]], {"N": 2}),
        ([["N", "K/8"], ["N", "ceil(K/8)"]], {"K": 8}),
        ([["N"]], {"K": 0}),
    ],
)
def test_unfixed_sizes(shapes: list[list[str]], unfixed: dict[str, int]) -> None:
    assert unfixed_sizes(tuple(parse_shape(list(shape)) for shape in shapes)) == unfixed


def test_exact_layout_drops_the_ceil() -> None:
    assert exact_layout((parse_shape(["ceil(N/2)", "K"]), parse_shape(["N", "ceil(K/8)"]))) == "[N/2, K] or [N, K/8]"


@pytest.mark.parametrize(
    ("packing", "dtype", "shape", "extra", "path"),
    [
        ("int32_k", "int32", '[N, "ceil(K/8)"]', "", "weight.tensor.shape"),
        ("int4_n", "uint8", '["ceil(N/2)", K]', "", "weight.tensor.shape"),
        (
            "int32_k",
            "int32",
            '[N, "ceil(K/8)"]',
            "  shape_tensor: {name: weight_shape, dtype: int64, shape: [2], optional: true}\n",
            "weight.shape_tensor.optional",
        ),
        ("int32_k", "int32", "[N, K/8]", "", None),
        (
            "int32_k",
            "int32",
            '[N, "ceil(K/8)"]',
            "  shape_tensor: {name: weight_shape, dtype: int64, shape: [2]}\n",
            None,
        ),
    ],
)
def test_load_problems(packing: str, dtype: str, shape: str, extra: str, path: str | None) -> None:
    scheme = parse_scheme_text(INT4.format(packing=packing, dtype=dtype, shape=shape, extra=extra))
    problems = load_problems(scheme)
    assert [p for p, _ in problems] == ([] if path is None else [path])
    if path == "weight.tensor.shape" and packing == "int4_n":
        assert "does not fix N: one stored size stands for 2 values of N" in problems[0][1]
        assert "a layout that fixes N ([N/2, K])" in problems[0][1]


def test_every_builtin_gives_back_its_layer_size() -> None:
    files = sorted(BUILTIN.rglob("*.yaml"))
    assert len(files) >= 18
    for file in files:
        assert load_problems(parse_scheme_file(file)) == [], file
