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
    with pytest.raises(SchemeError, match=r"absent\.yaml: does not exist; check the path"):
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


# --- "given or not" is decided from the value: omitted, null and none all mean absent ---------

FP8_DYNAMIC_TEXT = (BUILTIN / "compressed-tensors" / "FP8_DYNAMIC.yaml").read_text()
FP8_STATIC_TEXT = (BUILTIN / "compressed-tensors" / "FP8.yaml").read_text()
FP8_BLOCK_TEXT = (BUILTIN / "compressed-tensors" / "FP8_BLOCK.yaml").read_text()
INCOMPLETE = "the descriptor is incomplete"


@pytest.mark.parametrize("written", ["none", "null", "~"])
def test_packing_none_or_null_is_the_default(written: str) -> None:
    text = FP8_DYNAMIC_TEXT.replace("  format: e4m3\n  tensor:", f"  format: e4m3\n  packing: {written}\n  tensor:", 1)
    assert f"packing: {written}" in text
    assert parse_scheme_text(text, "x.yaml") == parse_scheme_text(FP8_DYNAMIC_TEXT, "x.yaml")


@pytest.mark.parametrize("written", ["none", "null"])
def test_optional_sections_none_or_null_are_absent(written: str) -> None:
    text = FP8_DYNAMIC_TEXT.replace(
        "  format: e4m3\n  tensor:", f"  format: e4m3\n  global_scale: {written}\n  zero_point: {written}\n  tensor:", 1
    )
    text += f"fused: {written}\ntolerated: {written}\ninput_pre_scale: {written}\n"
    scheme = parse_scheme_text(text, "x.yaml")
    assert scheme == parse_scheme_text(FP8_DYNAMIC_TEXT, "x.yaml")
    assert scheme.fused.policy == "per_partition" and scheme.fused.fallback == "refuse"


def test_group_size_null_outside_group_granularity_is_absent() -> None:
    text = FP8_DYNAMIC_TEXT.replace("granularity: channel\n", "granularity: channel\n    group_size: null\n", 1)
    text = text.replace("granularity: token\n", "granularity: token\n  group_size: none\n", 1)
    assert parse_scheme_text(text, "x.yaml").activation is not None


STATIC_SCALE = (
    "  scale:\n    stored: multiplier\n"
    "    tensor: {name: input_scale, dtype: [float32, bfloat16, float16], shape: [1]}\n"
)

WEIGHT_GROUP, ACT_GROUP = "weight.scale.group_size", "activation.group_size"

# (case, base text, the key's line as written, its replacement, key path, value as the message shows it)
NEEDED_BUT_ABSENT: list[tuple[str, str, str, str, str, str]] = [
    ("weight group_size null", NVFP4_TEXT, "    group_size: 16\n", "    group_size: null\n", WEIGHT_GROUP, "null"),
    ("weight group_size none", NVFP4_TEXT, "    group_size: 16\n", "    group_size: none\n", WEIGHT_GROUP, "'none'"),
    ("block null", FP8_BLOCK_TEXT, "    block: [128, 128]\n", "    block: null\n", "weight.scale.block", "null"),
    ("block none", FP8_BLOCK_TEXT, "    block: [128, 128]\n", "    block: none\n", "weight.scale.block", "'none'"),
    ("activation group_size null", FP8_BLOCK_TEXT, "  group_size: 128\n", "  group_size: ~\n", ACT_GROUP, "null"),
    ("static scale none", FP8_STATIC_TEXT, STATIC_SCALE, "  scale: none\n", "activation.scale", "'none'"),
    ("static scale null", FP8_STATIC_TEXT, STATIC_SCALE, "  scale: null\n", "activation.scale", "null"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "base", "old", "new", "path", "shown"), NEEDED_BUT_ABSENT, ids=[c[0] for c in NEEDED_BUT_ABSENT]
)
def test_needed_key_given_as_null_or_none_is_located(
    case: str, base: str, old: str, new: str, path: str, shown: str
) -> None:
    assert old in base, case
    text = base.replace(old, new, 1)
    (line,) = parse_errors(text)
    number = line_of(text, new.rstrip("\n"))
    column = text.splitlines()[number - 1].index(": ") + 3  # the value's column
    assert line.startswith(f"bad.yaml:{number}:{column}: {path}: "), line
    assert line.endswith(f"; {shown} means absent"), line
    assert "needs" in line and INCOMPLETE not in line


@pytest.mark.parametrize(
    ("base", "old", "path"),
    [
        (NVFP4_TEXT, "    group_size: 16\n", "weight.scale"),
        (FP8_BLOCK_TEXT, "    block: [128, 128]\n", "weight.scale"),
        (FP8_BLOCK_TEXT, "  group_size: 128\n", "activation"),
        (FP8_STATIC_TEXT, STATIC_SCALE, "activation"),
    ],
    ids=["weight group_size", "block", "activation group_size", "static scale"],
)
def test_needed_key_omitted_is_located_at_its_section(base: str, old: str, path: str) -> None:
    assert old in base
    (line,) = parse_errors(base.replace(old, "", 1))
    assert f": {path}: " in line and "needs" in line and INCOMPLETE not in line, line


@pytest.mark.parametrize(
    ("base", "old", "new"),
    [
        (FP8_DYNAMIC_TEXT, "granularity: token\n", "granularity: token\n  group_size: 64\n"),
        (FP8_STATIC_TEXT, "granularity: tensor\n  dynamic", "granularity: tensor\n  group_size: 16\n  dynamic"),
    ],
    ids=["token", "tensor"],
)
def test_activation_group_size_outside_group_granularity_is_refused(base: str, old: str, new: str) -> None:
    assert old in base
    text = base.replace(old, new, 1)
    (line,) = parse_errors(text)
    number = line_of(text, "  group_size:")
    column = text.splitlines()[number - 1].index(":") + 3
    assert line.startswith(f"bad.yaml:{number}:{column}: activation.group_size: "), line
    assert "only applies to granularity 'group'" in line and "remove group_size" in line


def test_unknown_key_is_located_at_the_key() -> None:
    text = NVFP4_TEXT.replace("  global_scale:\n", "  globl_scale:\n", 1)
    lines = parse_errors(text)
    number = line_of(text, "globl_scale:")
    (line,) = [line for line in lines if "unknown key" in line]
    assert line.startswith(f"bad.yaml:{number}:3: weight.globl_scale: unknown key 'globl_scale'; allowed keys are ")
    assert line.endswith("did you mean 'global_scale'?")


def test_unknown_key_in_a_flow_mapping_is_located_at_the_key() -> None:
    text = NVFP4_TEXT.replace("{name: weight_packed,", "{nmae: weight_packed,", 1)
    number = line_of(text, "nmae:")
    column = text.splitlines()[number - 1].index("nmae") + 1
    lines = parse_errors(text)
    assert any(line.startswith(f"bad.yaml:{number}:{column}: weight.tensor.nmae: unknown key") for line in lines), lines


@pytest.mark.parametrize("element", ["int4", "uint4"])
def test_integer_4bit_activations_are_refused(element: str) -> None:
    text = FP8_DYNAMIC_TEXT.replace("activation:\n  format: e4m3", f"activation:\n  format: {element}", 1)
    (line,) = parse_errors(text)
    number = line_of(text, f"format: {element}")
    assert line.startswith(f"bad.yaml:{number}:11: activation.format: '{element}' is not one of 'e2m1', "), line


def test_text_that_is_not_a_string_is_a_scheme_error() -> None:
    with pytest.raises(SchemeError, match=r"<string>: a descriptor is YAML text \(str\), not NoneType"):
        parse_scheme_text(None)  # type: ignore[arg-type]


# --- YAML Python cannot read: located problems, never a traceback (audit F4) ---------------


@pytest.mark.parametrize("depth", [40, 300, 5000])
def test_deep_nesting_is_a_located_problem(depth: int) -> None:
    with pytest.raises(SchemeError) as info:
        parse_scheme_text("name: " + "[" * depth + "]" * depth + "\n", "bad.yaml")
    (line,) = str(info.value).splitlines()
    assert re.match(r"^bad\.yaml:1:\d+: (name[\[\]0]*\.\.\.: )?mappings and lists are nested", line), line
    assert "32 levels" in line and "object at" not in line


def test_deep_mapping_nesting_is_a_located_problem() -> None:
    text = "name: x\nweight:\n" + "".join("  " * (i + 1) + f"k{i}:\n" for i in range(60)) + "  " * 61 + "v: 1\n"
    lines = parse_errors(text)
    assert any("nested more than 32 levels" in line for line in lines), lines


@pytest.mark.parametrize(
    ("written", "fragment"),
    [("1" + "0" * 5000, "(a number of 5001 digits) is too large"), ("0x_", "'0x_' is not a valid number")],
    ids=["5001 digits", "0x_"],
)
def test_unreadable_numbers_are_located(written: str, fragment: str) -> None:
    text = NVFP4_TEXT.replace("    group_size: 16\n", f"    group_size: {written}\n", 1)
    (line,) = parse_errors(text)
    number = line_of(text, "    group_size: " + written[:5])
    assert line.startswith(f"bad.yaml:{number}:17: weight.scale.group_size: "), line[:200]
    assert fragment in line and len(line) < 300


def test_unreadable_number_as_key_is_located() -> None:
    lines = parse_errors(NVFP4_TEXT + "0x_: 1\n")
    assert any("'0x_' is not a valid number" in line for line in lines), lines


def test_nul_byte_is_located_by_its_position() -> None:
    text = NVFP4_TEXT.replace("producer: compressed-tensors", "producer: compr\0essed-tensors", 1)
    with pytest.raises(SchemeError) as info:
        parse_scheme_text(text, "bad.yaml")
    number = line_of(text, "\0")
    column = text.splitlines()[number - 1].index("\0") + 1
    assert str(info.value).startswith(f"bad.yaml:{number}:{column}: not valid YAML: character U+0000 is not allowed")


# --- declared shapes must agree with packing and scale granularity (audit F5) ---------------


W4A16_TEXT = (BUILTIN / "compressed-tensors" / "W4A16.yaml").read_text()
AWQ_TEXT = (BUILTIN / "modelopt" / "W4A16_AWQ.yaml").read_text()
PB_WO_TEXT = (BUILTIN / "modelopt" / "fp8_pb_wo.yaml").read_text()
SCALE_PATH, WEIGHT_PATH = "weight.scale.tensor.shape", "weight.tensor.shape"

# (case, base text, old, new, key path, fragment)
INCONSISTENT: list[tuple[str, str, str, str, str, str]] = [
    ("group size vs scale", NVFP4_TEXT, "group_size: 16\n    format", "group_size: 32\n    format", SCALE_PATH,
     "[N, K/16] does not fit granularity 'group' with group_size 32 (one scale per 32 elements along K); "
     "declare [N, K/32] (or [N, ceil(K/32)])"),
    ("nibbles_k", NVFP4_TEXT, "shape: [N, K/2]", "shape: [N, K/3]", WEIGHT_PATH,
     "[N, K/3] does not fit format 'e2m1' with packing 'nibbles_k' (two 4-bit elements per byte along K); "
     "declare [N, K/2] (or [N, ceil(K/2)])"),
    ("weight empty", NVFP4_TEXT, "shape: [N, K/2]", "shape: []", WEIGHT_PATH, "[] does not fit format 'e2m1'"),
    ("weight 1-D", FP8_DYNAMIC_TEXT, "shape: [N, K]", "shape: [K]", WEIGHT_PATH, "declare [N, K]"),
    ("int32_k", W4A16_TEXT, 'shape: [N, "ceil(K/8)"]', "shape: [N, K/4]", WEIGHT_PATH,
     "(8 elements per int32 along K); declare [N, K/8] (or [N, ceil(K/8)])"),
    ("int4_n", AWQ_TEXT, "shape: [N/2, K]", "shape: [N, K/2]", WEIGHT_PATH, "declare [N/2, K] (or [ceil(N/2), K])"),
    ("channel", FP8_DYNAMIC_TEXT, "shape: [N, 1]", "shape: [1, N]", SCALE_PATH, "declare [N, 1] or [N]"),
    ("tensor", FP8_STATIC_TEXT, "shape: [1]}\nactivation", "shape: [N]}\nactivation", SCALE_PATH,
     "declare [] or [1]"),
    ("block", FP8_BLOCK_TEXT, '"ceil(K/128)"]', '"ceil(K/64)"]', SCALE_PATH,
     "declare [N/128, K/128] (or [ceil(N/128), ceil(K/128)]) or [N/128, 1, K/128, 1]"),
    ("block only single", PB_WO_TEXT, '[["ceil(N/128)", 1, "ceil(K/128)", 1], []]', "[[], [1]]",
     SCALE_PATH + ".any_of[0]", "[] does not fit granularity 'block'"),
    ("global scale", NVFP4_TEXT, "name: weight_global_scale, dtype: [float32, bfloat16, float16], shape: [1]",
     "name: weight_global_scale, dtype: [float32, bfloat16, float16], shape: [N]",
     "weight.global_scale.tensor.shape", "[N] does not fit a global scale"),
    ("zero point", W4A16_ASYM_TEXT, '["ceil(N/8)", "ceil(K/128)"]', '[N, "ceil(K/128)"]',
     "weight.zero_point.tensor.shape", "declare [N/8, K/128] (or [ceil(N/8), ceil(K/128)])"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "base", "old", "new", "path", "fragment"), INCONSISTENT, ids=[c[0] for c in INCONSISTENT]
)
def test_shapes_that_contradict_the_layout_are_located(
    case: str, base: str, old: str, new: str, path: str, fragment: str
) -> None:
    assert old in base, case
    text = base.replace(old, new, 1)
    lines = parse_errors(text)
    assert any(f": {path}: " in line and fragment in line for line in lines), lines
    assert len(lines) == 1 or case == "block only single", lines


def test_every_ceil_form_is_accepted() -> None:
    text = NVFP4_TEXT.replace("shape: [N, K/2]", 'shape: [N, "ceil(K/2)"]', 1)
    text = text.replace("shape: [N, K/16]", 'shape: {any_of: [[N, K/16], [N, "ceil(K/16)"]]}', 1)
    assert parse_scheme_text(text, "x.yaml").weight.scale.tensor.describe_shapes() == "[N, K/16] or [N, ceil(K/16)]"


@pytest.mark.parametrize(
    ("base", "old", "new", "path"),
    [
        (
            NVFP4_TEXT,
            "    group_size: 16\n",
            "    group_size: 1000000000000000000000000000000000000000\n",
            WEIGHT_GROUP,
        ),
        (FP8_BLOCK_TEXT, "block: [128, 128]", "block: [128, 2097152]", "weight.scale.block[1]"),
        (FP8_BLOCK_TEXT, "  group_size: 128\n", "  group_size: 2097152\n", ACT_GROUP),
    ],
    ids=["group_size 10**39", "block", "activation group_size"],
)
def test_sizes_are_bounded(base: str, old: str, new: str, path: str) -> None:
    assert old in base
    lines = parse_errors(base.replace(old, new, 1))
    assert any(f": {path}: " in line and "too large; use an integer from 1 to 1048576" in line for line in lines), lines


def test_shape_divisor_is_bounded() -> None:
    (line,) = parse_errors(NVFP4_TEXT.replace("shape: [N, K/16]", "shape: [N, K/99999999999]", 1))
    assert ": weight.scale.tensor.shape[1]: 'K/99999999999': the divisor is larger than 1048576" in line, line


# (case, weights as written, key, fragment)
BAD_ARGUMENTS: list[tuple[str, str, str, str]] = [
    ("num_bits word", "num_bits: four", "num_bits", "'four' is not one of 4, 8"),
    ("num_bits 3", "num_bits: 3", "num_bits", "3 is not one of 4, 8"),
    ("num_bits bool", "num_bits: true", "num_bits", "True is not one of 4, 8"),
    ("type", "type: 7", "type", "7 is not one of 'int', 'float'"),
    ("strategy", "strategy: nope", "strategy", "'nope' is not one of 'tensor', 'channel', 'group'"),
    ("group_size 0", "group_size: 0", "group_size", "0 is not -1 (per channel) or an integer from 1 to 1048576"),
    ("group_size str", "group_size: '16'", "group_size", "'16' is not -1"),
    ("symmetric", "symmetric: maybe", "symmetric", "'maybe' is not one of true, false"),
    ("dynamic", "dynamic: sometimes", "dynamic", "'sometimes' is not one of true, false, 'local'"),
    ("block_structure", "block_structure: 128xabc", "block_structure", "'128xabc' is not [rows, columns]"),
    ("actorder", "actorder: 3", "actorder", "3 is not true, false or one of 'group'"),
]


@pytest.mark.parametrize(("case", "written", "key", "fragment"), BAD_ARGUMENTS, ids=[c[0] for c in BAD_ARGUMENTS])
def test_compressed_tensors_argument_values_are_checked(case: str, written: str, key: str, fragment: str) -> None:
    rule = "weights: {num_bits: 4, type: float, strategy: tensor_group, group_size: 16, symmetric: true}"
    assert rule in NVFP4_TEXT
    arguments = dict(item.split(": ", 1) for item in rule[10:-1].split(", "))
    arguments[written.split(": ")[0]] = written.split(": ", 1)[1]
    text = NVFP4_TEXT.replace(rule, "weights: {" + ", ".join(f"{k}: {v}" for k, v in arguments.items()) + "}", 1)
    (line,) = parse_errors(text)
    number = line_of(text, "    weights:")
    column = text.splitlines()[number - 1].index(written) + len(key) + 3
    assert line.startswith(f"bad.yaml:{number}:{column}: detect.compressed-tensors.weights.{key}: {fragment}"), line


def test_compressed_tensors_arguments_allow_null_and_library_spellings() -> None:
    rule = "weights: {num_bits: 4, type: float, strategy: tensor_group, group_size: 16, symmetric: true}"
    written = (
        "weights: {num_bits: 4, type: FLOAT, strategy: TENSOR_GROUP, group_size: 16, symmetric: true, "
        "dynamic: null, block_structure: 16x16, actorder: null, observer: minmax, scale_dtype: float8_e4m3fn}"
    )
    assert parse_scheme_text(NVFP4_TEXT.replace(rule, written, 1), "x.yaml").detect.compressed_tensors is not None


# --- shape items and scheme names (audit F11, F15) -------------------------------------------


def test_non_scalar_shape_item_shows_the_plain_value() -> None:
    (line,) = parse_errors(NVFP4_TEXT.replace("shape: [N, K/2]", "shape: [{a: 1}, K/2]", 1))
    assert ": weight.tensor.shape[0]: {'a': 1} is not a dimension" in line and "Node(" not in line, line


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("'bad\\x1b[31mred\\x07'", "contains the character '\\x1b'"),
        ("'a\\u202eb'", "contains the character '\\u202e'"),
        ("'my scheme'", "contains whitespace"),
        ("'../../etc/passwd'", "has an empty, '.' or '..' part"),
        ("acme//W4", "has an empty, '.' or '..' part"),
        ("/acme/W4", "has an empty, '.' or '..' part"),
        ("acme/./W4", "has an empty, '.' or '..' part"),
        ("none", "means absent"),
    ],
)
def test_scheme_names_are_restricted(name: str, fragment: str) -> None:
    text = NVFP4_TEXT.replace("name: compressed-tensors/NVFP4", f'name: "{name[1:-1]}"' if name[0] == "'" else
                              f"name: {name}", 1)  # fmt: skip
    (line,) = parse_errors(text)
    assert line.startswith("bad.yaml:1:7: name: ") and fragment in line, line
    assert "use letters, digits" in line or "choose another name" in line


@pytest.mark.parametrize("name", ["acme/W4A16_G64", "a.b-c_d/E.F", "x"])
def test_ordinary_scheme_names_are_accepted(name: str) -> None:
    text = NVFP4_TEXT.replace("name: compressed-tensors/NVFP4", f"name: {name}", 1)
    assert parse_scheme_text(text, "x.yaml").name == name


RECIPROCAL_E4M3 = """
name: test/reciprocal-e4m3
weight:
  format: e2m1
  packing: nibbles_k
  tensor: {name: weight_packed, dtype: uint8, shape: [N, K/2]}
  scale:
    granularity: group
    group_size: 16
    format: e4m3
    stored: reciprocal
    tensor: {name: weight_scale, dtype: float8_e4m3fn, shape: [N, K/16]}
"""


@pytest.mark.parametrize(("scale_format", "dtype"), [("e4m3", "float8_e4m3fn"), ("e8m0", "uint8")])
def test_a_reciprocal_e4m3_or_e8m0_scale_is_refused_at_its_stored_key(scale_format: str, dtype: str) -> None:
    text = RECIPROCAL_E4M3.replace("format: e4m3", f"format: {scale_format}").replace("float8_e4m3fn", dtype)
    with pytest.raises(SchemeError) as info:
        parse_scheme_text(text, "r.yaml")
    assert str(info.value) == (
        f"r.yaml:11:13: weight.scale.stored: a {scale_format} scale is stored as the dequant multiplier; its "
        f"reciprocal is not, in general, a {scale_format} value; use stored: multiplier (or a float scale format "
        "for a reciprocal)"
    )


ZERO_POINTS = """
name: test/zero-points
weight:
  format: {weight}
  tensor: {{name: weight, dtype: {dtype}, shape: [N, K]}}
  scale:
    granularity: channel
    format: float
    stored: multiplier
    tensor: {{name: weight_scale, dtype: float32, shape: [N, 1]}}
  zero_point:
    format: {zero}
    tensor: {{name: weight_zero_point, dtype: {zdtype}, shape: [N, 1]}}
"""


@pytest.mark.parametrize(
    ("weight", "dtype", "zero", "zdtype", "problem"),
    [
        ("uint8", "uint8", "int4", "int8", "zero points of uint8 weights lie in [0, 255], which 'int4'"),
        ("uint8", "uint8", "int8", "int8", "zero points of uint8 weights lie in [0, 255], which 'int8'"),
        ("int8", "int8", "uint8", "uint8", "zero points of int8 weights lie in [-128, 127], which 'uint8'"),
        ("uint8", "uint8", "uint8", "uint8", None),
        ("int8", "int8", "int8", "int8", None),
    ],
)
def test_a_zero_point_format_must_hold_the_weights_range(
    weight: str, dtype: str, zero: str, zdtype: str, problem: str | None
) -> None:
    text = ZERO_POINTS.format(weight=weight, dtype=dtype, zero=zero, zdtype=zdtype)
    if problem is None:
        assert parse_scheme_text(text, "z.yaml").weight.zero_point is not None
        return
    with pytest.raises(SchemeError, match=re.escape(f"z.yaml:12:13: weight.zero_point.format: {problem}")):
        parse_scheme_text(text, "z.yaml")


def test_integer_ranges_are_the_formats_own() -> None:
    from qscheme.descriptor.parse import INTEGER_RANGE
    from qscheme.formats import get_element_format

    for name, (low, high) in INTEGER_RANGE.items():
        element = get_element_format(name)
        assert (low, high) == (int(element.min_value), int(element.max_value)), name


@pytest.mark.parametrize("zdtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_zero_points_are_declared_as_integers(zdtype: str) -> None:
    # float zero points would be written by quantize_weight and refused by dequantize_weight
    text = ZERO_POINTS.format(weight="uint8", dtype="uint8", zero="uint8", zdtype=zdtype)
    with pytest.raises(SchemeError) as caught:
        parse_scheme_text(text, "z.yaml")
    message = str(caught.value)
    assert "z.yaml:13:13: weight.zero_point.tensor.dtype" in message, message
    assert f"{zdtype!r} does not fit zero points with packing 'none' (integers)" in message, message
    assert "'int8', 'uint8', 'int32'" in message, message


def test_packed_zero_points_are_int32_words() -> None:
    source = Path(__file__).parent.parent / "schemes" / "compressed-tensors" / "W4A16_ASYM.yaml"
    original = source.read_text(encoding="utf-8")
    declared = "tensor: {name: weight_zero_point, dtype: int32,"
    assert declared in original
    text = original.replace(declared, declared.replace("int32", "int8"))
    with pytest.raises(
        SchemeError,
        match=r"weight\.zero_point\.tensor\.dtype: 'int8' does not fit zero points "
        r"with packing 'int32_n' \(integers\); use 'int32'",
    ):
        parse_scheme_text(text, "z.yaml")
