"""qscheme.formats.table: one torch-free row of facts per element format, read by every layer."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from qscheme.formats import ELEMENT_FORMATS, FORMAT_FACTS, representable_values
from qscheme.formats.elements import _CODECS
from qscheme.formats.table import (
    ANY_FLOAT,
    activation_formats,
    float_scale_formats,
    integer_formats,
    is_float_scale,
    range_half,
    scale_dtypes,
    scale_formats,
    weight_formats,
)


def test_every_row_has_codecs_and_an_element_format() -> None:
    assert list(_CODECS) == list(FORMAT_FACTS) == list(ELEMENT_FORMATS)
    for name, facts in FORMAT_FACTS.items():
        element = ELEMENT_FORMATS[name]
        assert element.facts is facts
        assert (element.bits, element.kind, element.signed) == (facts.bits, facts.kind, facts.signed)
        assert (element.max_value, element.min_value) == (facts.max_value, facts.min_value)
        assert element.storage_dtype == getattr(torch, facts.storage_dtype)


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "fp16", "bf16", "fp32"])
def test_float_rows_match_torch(name: str) -> None:
    facts = FORMAT_FACTS[name]
    info = torch.finfo(getattr(torch, facts.storage_dtype))
    assert facts.bits == info.bits == 1 + facts.exponent_bits + facts.mantissa_bits
    assert facts.max_value == info.max and facts.min_value == info.min
    assert facts.smallest_normal == info.smallest_normal
    assert facts.smallest_positive == float(torch.tensor(info.smallest_normal * 2.0**-facts.mantissa_bits))


@pytest.mark.parametrize("name", [name for name, f in FORMAT_FACTS.items() if f.bits <= 8])
def test_narrow_rows_match_their_decoded_values(name: str) -> None:
    facts = FORMAT_FACTS[name]
    values = representable_values(name)
    assert (float(values.min()), float(values.max())) == (facts.min_value, facts.max_value)
    assert float(values[values > 0].min()) == facts.smallest_positive
    if facts.kind == "int":
        info = torch.iinfo(getattr(torch, facts.storage_dtype))
        assert info.min <= facts.min_value and facts.max_value <= info.max


def test_derived_facts() -> None:
    assert [(f.name, f.per_byte, f.per_int32) for f in FORMAT_FACTS.values() if f.bits == 4] == [
        ("e2m1", 2, 8),
        ("int4", 2, 8),
        ("uint4", 2, 8),
    ]
    assert (range_half("e2m1"), range_half("fp8"), range_half("int8")) == (6.0, 448.0, 127.5)
    assert FORMAT_FACTS["e2m1"].smallest_normal == 1.0 and FORMAT_FACTS["e2m1"].smallest_positive == 0.5
    assert [f.name for f in FORMAT_FACTS.values() if f.scale_only] == ["e8m0"]
    assert FORMAT_FACTS["e8m0"].smallest_positive == 2.0**-127


def test_descriptor_vocabularies_come_from_the_table() -> None:
    # the lists every layer used to write out, in the order their messages show them
    assert weight_formats() == ("e2m1", "e4m3", "e5m2", "int2", "int3", "int4", "uint4", "int8", "uint8")
    assert activation_formats() == ("e2m1", "e4m3", "e5m2", "int8", "uint8")
    assert scale_formats() == ("e4m3", "e8m0", "fp32", "fp16", "bf16", "float")
    assert float_scale_formats() == ("fp16", "bf16", "fp32")
    assert integer_formats() == ("int2", "int3", "int4", "uint4", "int8", "uint8")
    assert scale_dtypes(ANY_FLOAT) == ("float16", "bfloat16", "float32")
    assert scale_dtypes("e8m0") == ("uint8",)
    assert [name for name in scale_formats() if is_float_scale(name)] == ["fp32", "fp16", "bf16", "float"]

    from qscheme.descriptor import model, parse
    from qscheme.descriptor.consistency import FOUR_BIT
    from qscheme.kernels.declaration import WEIGHT_ELEMENT_FORMATS
    from qscheme.triton.spec import ELEMENT_IDS, FOUR_BIT_ELEMENTS

    assert parse.ELEMENT_FORMATS == WEIGHT_ELEMENT_FORMATS == weight_formats()
    assert model.SCALE_FORMATS == scale_formats() and model.ACTIVATION_FORMATS == activation_formats()
    assert parse.NO_RECIPROCAL == {"e4m3", "e8m0"}
    assert FOUR_BIT == FOUR_BIT_ELEMENTS == {"e2m1", "int4", "uint4"}
    assert set(ELEMENT_IDS) <= set(weight_formats())  # the formats the Triton kernels decode
    assert parse.UNPACKED_DTYPE == {
        "e4m3": "float8_e4m3fn",
        "e5m2": "float8_e5m2",
        "int2": "int8",
        "int3": "int8",
        "int4": "int8",
        "uint4": "uint8",
        "int8": "int8",
        "uint8": "uint8",
    }


@pytest.mark.subprocess
def test_the_table_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "import qscheme.formats.table, qscheme.formats, qscheme.descriptor\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_kernel_families_cover_the_table_families() -> None:
    from qscheme.descriptor.model import _FAMILY_BY_PAIR
    from qscheme.kernels.declaration import ACTIVATION_FAMILIES, WEIGHT_FAMILIES

    families = {f.family for f in FORMAT_FACTS.values() if f.family is not None} | set(_FAMILY_BY_PAIR.values())
    # blocks and codebook: declared by descriptors (`packing: blocks`, `weight.table`), not by a format of the table
    assert set(WEIGHT_FAMILIES) == families | {"blocks", "codebook"}
    activation_families = {FORMAT_FACTS[name].family for name in activation_formats()}
    assert activation_families | {"nvfp4", "mxfp4", "none"} == set(ACTIVATION_FAMILIES)
