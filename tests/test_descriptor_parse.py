"""Descriptor parsing: valid files parse; each kind of broken file gives a located error."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from qscheme.descriptor import parse_scheme_file, parse_scheme_text
from qscheme.errors import SchemeError

BUILTIN = Path(__file__).resolve().parents[1] / "schemes"
NVFP4_TEXT = (BUILTIN / "compressed-tensors" / "NVFP4.yaml").read_text()
W4A16_ASYM_TEXT = (BUILTIN / "compressed-tensors" / "W4A16_ASYM.yaml").read_text()
LOCATED = re.compile(r"^bad\.yaml:(\d+):(\d+): ([\w.\[\]-]+|<top>): .+")


def parse_errors(text: str) -> list[str]:
    with pytest.raises(SchemeError) as info:
        parse_scheme_text(text, "bad.yaml")
    lines = str(info.value).splitlines()
    assert lines, "a SchemeError must say something"
    for line in lines:
        assert LOCATED.match(line), f"not located: {line!r}"
    return lines


def line_of(text: str, needle: str) -> int:
    for number, line in enumerate(text.splitlines(), start=1):
        if needle in line:
            return number
    raise AssertionError(needle)


def test_builtin_text_parses() -> None:
    scheme = parse_scheme_text(NVFP4_TEXT, "nvfp4.yaml")
    assert scheme.name == "compressed-tensors/NVFP4"
    assert scheme.weight.global_scale is not None
    assert scheme.weight.global_scale.stored == "reciprocal"
    assert scheme.activation is not None and scheme.activation.group_size == 16


def test_example_message_from_the_issue() -> None:
    text = NVFP4_TEXT.replace("stored: reciprocal", "stored: invert", 1)
    (line,) = parse_errors(text)
    number = line_of(text, "stored: invert")
    column = text.splitlines()[number - 1].index("invert") + 1
    assert line == (
        f"bad.yaml:{number}:{column}: weight.global_scale.stored: 'invert' is not one of 'multiplier', 'reciprocal'"
    )


# Each case: (description, transform of the NVFP4 text, expected key path, expected fragment).
BROKEN: list[tuple[str, str, str, str, str]] = [
    ("unknown top key", "detect:", "detetc:", "detetc", "did you mean 'detect'"),
    (
        "bad element format",
        "format: e2m1\n  packing",
        "format: e2m2\n  packing",
        "weight.format",
        "'e2m2' is not one of",
    ),
    ("bad packing", "packing: nibbles_k", "packing: nibbles", "weight.packing", "'nibbles' is not one of"),
    (
        "bad granularity",
        "granularity: group\n    group_size: 16\n    format: e4m3",
        "granularity: grp\n    group_size: 16\n    format: e4m3",
        "weight.scale.granularity",
        "'grp' is not one of",
    ),
    (
        "group size zero",
        "group_size: 16\n    format: e4m3",
        "group_size: 0\n    format: e4m3",
        "weight.scale.group_size",
        "not an integer >= 1",
    ),
    ("bad dtype", "dtype: float8_e4m3fn", "dtype: float8", "weight.scale.tensor.dtype", "'float8' is not one of"),
    ("bad shape expr", "shape: [N, K/16]", "shape: [N, M/16]", "weight.scale.tensor.shape[1]", "is not a dimension"),
    ("shape not list", "shape: [N, K/2]", "shape: N", "weight.tensor.shape", "not a list of dimensions"),
    ("dynamic not bool", "dynamic: true", "dynamic: maybe", "activation.dynamic", "not one of true, false"),
    ("bad fused policy", "policy: per_partition", "policy: max", "fused.policy", "'max' is not one of"),
    (
        "scale dtype vs format",
        "format: e4m3\n    stored: multiplier\n    tensor: {name: weight_scale, dtype: float8_e4m3fn",
        "format: e4m3\n    stored: multiplier\n    tensor: {name: weight_scale, dtype: float32",
        "weight.scale.tensor.dtype",
        "does not fit scale format 'e4m3'",
    ),
    (
        "packed dtype",
        "tensor: {name: weight_packed, dtype: uint8",
        "tensor: {name: weight_packed, dtype: int32",
        "weight.tensor.dtype",
        "does not fit format 'e2m1'",
    ),
    (
        "missing key",
        "    stored: multiplier\n    tensor: {name: weight_scale",
        "    tensor: {name: weight_scale",
        "weight.scale",
        "missing required key 'stored'",
    ),
    ("python tag", "name: compressed-tensors/NVFP4", "name: !!python/name:os.system", "name", "is not allowed"),
    (
        "duplicate key",
        "producer: compressed-tensors",
        "producer: compressed-tensors\nproducer: modelopt",
        "producer",
        "duplicate key",
    ),
    ("static without scale", "dynamic: true", "dynamic: false", "activation", "needs scale"),
    ("tolerated clash", "fused:", "tolerated: [weight_scale]\nfused:", "tolerated", "both declared and tolerated"),
    ("bad producer", "producer: compressed-tensors", "producer: acme", "producer", "'acme' is not one of"),
    ("bad yaml", "weight:\n", "weight:\n  - [\n", "<top>", "not valid YAML"),
]


@pytest.mark.parametrize(("case", "old", "new", "path", "fragment"), BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_descriptor_is_located(case: str, old: str, new: str, path: str, fragment: str) -> None:
    assert old in NVFP4_TEXT, case
    text = NVFP4_TEXT.replace(old, new, 1)
    if case == "bad yaml":
        with pytest.raises(SchemeError) as info:
            parse_scheme_text(text, "bad.yaml")
        assert re.match(r"^bad\.yaml:\d+:\d+: not valid YAML", str(info.value))
        return
    lines = parse_errors(text)
    matching = [line for line in lines if f": {path}: " in line and fragment in line]
    assert matching, f"{case}: expected {path!r} with {fragment!r} in {lines}"


def test_several_errors_are_all_reported_in_line_order() -> None:
    text = NVFP4_TEXT.replace("stored: reciprocal", "stored: invert").replace("packing: nibbles_k", "packing: nib")
    lines = parse_errors(text)
    assert len(lines) == 3
    numbers = [int(LOCATED.match(line).group(1)) for line in lines]  # type: ignore[union-attr]
    assert numbers == sorted(numbers)


def test_zero_point_on_float_format_is_refused() -> None:
    text = W4A16_ASYM_TEXT.replace("format: int4\n  packing: int32_k", "format: e4m3\n  packing: none")
    lines = parse_errors(text)
    assert any("weight.zero_point" in line and "integer format" in line for line in lines), lines


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(SchemeError, match="cannot read the descriptor"):
        parse_scheme_file(tmp_path / "absent.yaml")


def test_empty_file() -> None:
    with pytest.raises(SchemeError, match="empty"):
        parse_scheme_text("", "bad.yaml")


def test_top_level_must_be_mapping() -> None:
    lines = parse_errors("- a\n- b\n")
    assert "not a mapping" in lines[0]


def test_shape_alternatives() -> None:
    text = (BUILTIN / "modelopt" / "fp8_pb_wo.yaml").read_text()
    scheme = parse_scheme_text(text, "x.yaml")
    spec = scheme.weight.scale.tensor
    assert spec.expected_shapes(300, 256) == [(3, 1, 2, 1), ()]


def test_loaded_yaml_equals_plain_yaml() -> None:
    """The located reader sees the same values as PyYAML's safe_load."""
    from qscheme.descriptor.nodes import read_yaml

    for path in BUILTIN.rglob("*.yaml"):
        root, problems = read_yaml(path.read_text(), str(path))
        assert not problems
        assert root is not None and root.plain() == yaml.safe_load(path.read_text())
