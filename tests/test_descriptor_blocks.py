"""The ``blocks:`` section of a descriptor: a block declared as data, and its located errors.

A scheme of packed blocks (``packing: blocks``) parses from YAML alone; every broken declaration
is a SchemeError at the file, line and key path of its cause, saying what is allowed. A new
layout written here, not one of the built-in GGUF types, decodes as its declaration says.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from qscheme.descriptor import parse_scheme_text
from qscheme.descriptor.blocks import Plane, plane_sources
from qscheme.errors import SchemeError
from qscheme.formats.blocks import decode_blocks

BUILTIN = Path(__file__).resolve().parents[1] / "schemes"
Q4_K = (BUILTIN / "gguf" / "Q4_K.yaml").read_text()
LOCATED = re.compile(r"^bad\.yaml:(\d+):(\d+): ([\w.\[\]-]+|<top>): .+")

# A layout of our own: 8 weights in 6 bytes: a bf16 scale, an fp16 minimum, 8 three-bit codes
# packed as a 2-bit plane and a 1-bit plane, and weight = s * (q - 3) + m.
TOY = """\
name: acme/TOY3
description: three-bit codes with a bf16 scale and an fp16 minimum
weight:
  packing: blocks
  tensor: {name: weight, dtype: uint8, shape: [N, "K/8*7"]}
  blocks:
    elements: 8
    bytes: 7
    fields:
      - {name: s, format: bf16}
      - {name: m, format: fp16}
      - {name: lo, bytes: 2}
      - {name: hi, bytes: 1}
    integers:
      q: {count: 8, planes: [{field: lo, bits: 2, run: 2}, {field: hi, bits: 1}], offset: -3}
    element: {integer: q}
    scale: [s]
    minimum: {add: [m]}
activation: none
"""


def parse_errors(text: str) -> list[str]:
    with pytest.raises(SchemeError) as info:
        parse_scheme_text(text, "bad.yaml")
    lines = str(info.value).splitlines()
    for line in lines:
        assert LOCATED.match(line), f"not located: {line!r}"
    return lines


def test_a_new_layout_is_yaml_only_and_decodes_as_declared() -> None:
    scheme = parse_scheme_text(TOY, "toy.yaml")
    layout = scheme.weight.blocks
    assert layout is not None and scheme.weight_family == "blocks"
    assert layout.describe() == "blocks of 8 in 7 bytes (7 bits per weight): s * (q - 3) + m"
    codes = [5, 0, 7, 2, 3, 6, 1, 4]
    # lo: run of 2 bytes, 4 two-bit groups per byte: value f*2 + j sits in byte j at bit 2f
    lo = [0, 0]
    for value, code in enumerate(codes):
        group, byte = divmod(value, 2)
        lo[byte] |= (code & 3) << (2 * group)
    hi = sum(((code >> 2) & 1) << value for value, code in enumerate(codes))
    scale = torch.tensor([0.5], dtype=torch.bfloat16).view(torch.uint8)
    minimum = torch.tensor([-1.25], dtype=torch.float16).view(torch.uint8)
    raw = torch.cat([scale, minimum, torch.tensor([*lo, hi], dtype=torch.uint8)]).reshape(1, 7)
    got = decode_blocks(raw, layout)
    want = torch.tensor([[0.5 * (c - 3) - 1.25 for c in codes]])
    assert torch.equal(got, want)


def test_plane_order_puts_group_f_of_byte_j_at_value_f_times_run_plus_j() -> None:
    sources = plane_sources(Plane("qs", 4, run=16), 32, 16)
    assert not isinstance(sources, str)
    assert sources[0] == ("qs", 0, 0, 4) and sources[15] == ("qs", 15, 0, 4)
    assert sources[16] == ("qs", 0, 4, 4) and sources[31] == ("qs", 15, 4, 4)
    adjacent = plane_sources(Plane("qs", 4), 4, 2)
    assert not isinstance(adjacent, str)
    assert [s[1:3] for s in adjacent] == [(0, 0), (0, 4), (1, 0), (1, 4)]


BROKEN: list[tuple[str, str, str, str]] = [
    # (old text, new text, key path, message fragment)
    ("bytes: 144", "bytes: 150", "weight.blocks.fields", "the fields hold 144 bytes, but bytes is 150"),
    ("{name: d, format: fp16}", "{name: d, format: fp12}", "weight.blocks.fields[0].format", "'fp12' is not one of"),
    ("{name: dmin, format: fp16}", "{name: d, format: fp16}", "weight.blocks.fields[1].name", "declared twice"),
    ("{name: qs, bytes: 128}", "{name: qs, bytes: 128, format: fp16}", "weight.blocks.fields[3]", "not both"),
    (
        "{field: qs, bits: 4, run: 32}",
        "{field: qs, bits: 3, run: 32}",
        "weight.blocks.integers.q.planes[0]",
        "do not divide a byte",
    ),
    (
        "{field: qs, bits: 4, run: 32}",
        "{field: qs, bits: 4, run: 48}",
        "weight.blocks.integers.q.planes[0]",
        "whole runs",
    ),
    (
        "{field: qs, bits: 4, run: 32}",
        "{field: qz, bits: 4, run: 32}",
        "weight.blocks.integers.q.planes[0].field",
        "'qz' is not one of",
    ),
    (
        "{field: qs, bits: 4, run: 32}",
        "{field: d, bits: 4, run: 32}",
        "weight.blocks.integers.q.planes[0].field",
        "'d' is not one of 'scales', 'qs'",
    ),
    (
        "[[0, 0, 6]], [[1, 0, 6]]",
        "[[0, 0, 6]], [[12, 0, 6]]",
        "weight.blocks.integers.sc.pieces[1][0]",
        "outside the 12-byte field",
    ),
    (
        "[[0, 0, 6]], [[1, 0, 6]]",
        "[[0, 0, 6]], [[1, 4, 6]]",
        "weight.blocks.integers.sc.pieces[1][0]",
        "width <= 8 - first_bit",
    ),
    ("[[0, 0, 6]], [[1, 0, 6]]", "[[0, 0, 6]], [[1, 0, 5]]", "weight.blocks.integers.sc", "the same width"),
    ("sc: {count: 8,", "sc: {count: 7,", "weight.blocks.integers.sc.pieces", "8 values listed, but count is 7"),
    ("scale: [d, sc]", "scale: [d, sx]", "weight.blocks.scale[1]", "'sx' is not one of"),
    ("scale: [d, sc]", "scale: [d]", "weight.blocks.integers", "'sc' is declared but not used"),
    (
        "minimum: {subtract: [dmin, m]}",
        "minimum: {subtract: [m]}",
        "weight.blocks.fields",
        "field 'dmin' is declared but never read",
    ),
    (
        "minimum: {subtract: [dmin, m]}",
        "minimum: {minus: [dmin, m]}",
        "weight.blocks.minimum.minus",
        "unknown key 'minus'",
    ),
    (
        "element: {integer: q}",
        "element: {integer: sc}",
        "weight.blocks.element.integer",
        "'sc' has 8 values; the block has 256",
    ),
    (
        "element: {integer: q}",
        "element: {integer: q, table: [1, 2]}",
        "weight.blocks.element.table",
        "a list of 16 numbers",
    ),
    (
        "element: {integer: q}",
        "element: {integer: q, format: e4m3}",
        "weight.blocks.element.format",
        "'e4m3' codes are 8 bits",
    ),
    (
        'shape: [N, "K/256*144"]',
        'shape: [N, "K/256*128"]',
        "weight.tensor.shape",
        "does not hold whole blocks; declare [N, K/256*144]",
    ),
    ("dtype: uint8", "dtype: int32", "weight.tensor.dtype", "does not fit packed blocks (raw bytes); use 'uint8'"),
    ("    elements: 256\n", "", "weight.blocks", "missing required key 'elements'"),
]


@pytest.mark.parametrize(("old", "new", "path", "fragment"), BROKEN)
def test_a_broken_block_declaration_is_located(old: str, new: str, path: str, fragment: str) -> None:
    assert old in Q4_K, old
    text = Q4_K.replace(old, new, 1)
    errors = parse_errors(text)
    found = [line for line in errors if f": {path}: " in line and fragment in line]
    assert found, f"no error at {path} with {fragment!r} among:\n" + "\n".join(errors)


def test_a_blocks_weight_takes_no_format_or_scale_key() -> None:
    text = Q4_K.replace("  packing: blocks\n", "  packing: blocks\n  format: uint4\n", 1)
    (line,) = parse_errors(text)
    assert ": weight.format: unknown key 'format'" in line


def test_the_multiplied_dimension_needs_an_exact_division() -> None:
    errors = parse_errors(Q4_K.replace('"K/256*144"', '"ceil(K/256)*144"', 1))
    assert any("a multiplier needs an exact division" in line for line in errors)
