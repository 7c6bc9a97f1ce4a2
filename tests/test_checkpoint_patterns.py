"""qscheme.checkpoint.patterns: ``re:`` entries checked for catastrophic backtracking, matched fast."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qscheme.catalog import load_catalog
from qscheme.checkpoint import patterns
from qscheme.checkpoint.config import read_producer_config
from qscheme.checkpoint.detect import detect
from qscheme.checkpoint.patterns import (
    MAX_BACKTRACKING_REPEATS,
    MAX_NAME_LENGTH,
    any_of,
    compile_entries,
    compile_pattern,
    pattern_problem,
)
from qscheme.errors import CheckpointError
from qscheme.producers.compressed_tensors.config import CompressedTensorsConfig, ConfigGroup
from qscheme.storage import TensorInfo

NVFP4 = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True}
NAMES = [
    "lm_head",
    "model.embed_tokens",
    "model.layers.0.self_attn.q_proj",
    "model.layers.12.self_attn.o_proj",
    "model.layers.3.mlp.experts.17.down_proj",
    "model.layers.3.mlp.gate",
    "model.visual.blocks.0.attn.qkv",
    "language_model.model.layers.1.mlp.up_proj",
]
# Patterns as written in published compressed-tensors / llm-compressor configs.
PUBLISHED = [
    r".*lm_head",
    r"^lm_head$",
    r".*q_proj$",
    r".*mlp.gate$",
    r".*\.mlp\.gate$",
    r"vision_tower.*",
    r"model.visual.*",
    r".*self_attn.*",
    r"model.layers.[0-9]+.mlp.gate",
    r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj$",
    r"^(?:model\.)?layers\.\d+\.self_attn\.(?:q|k|v|o)_proj$",
    r".*layers\.\d+\..*\.(q|k|v)_proj$",
    r"(?i).*LM_HEAD",
    r"(?:\d+\.){2}x",
]
CATASTROPHIC = {
    r"(a+)+$": "nests a variable-length repeat inside a repeated group",
    r"(\w+\.?)+x$": "nests a variable-length repeat inside a repeated group",
    r"model\.(\w+\.)*q_proj": "nests a variable-length repeat inside a repeated group",
    r"(?:(?:a)*)*": "nests a variable-length repeat inside a repeated group",
    r"(a|ab)*c": "repeats a choice whose alternatives can match the same text or nothing",
    r"(?:.|a)*b": "repeats a choice whose alternatives can match the same text or nothing",
    r"(a)\1": "backreference",
    r"(?P<x>a)(?P=x)": "backreference",
    r"(a)?(?(1)b|c)": "conditional",
    r".*a.*b.*c.*d": "4 variable-length repeats",
    r".*_.*_.*proj$": "3 variable-length repeats",
    r"a?a?a?a?a?aaaaa": "5 variable-length repeats",
    r"(?:.*a){4}": "4 variable-length repeats",
}


@pytest.mark.parametrize("pattern", PUBLISHED)
def test_published_patterns_are_accepted_and_match_as_re_match(pattern: str) -> None:
    assert pattern_problem(pattern) is None
    compiled = compile_pattern("re:" + pattern)
    assert [bool(compiled.match(name)) for name in NAMES] == [bool(re.match(pattern, name)) for name in NAMES]


@pytest.mark.parametrize(("pattern", "why"), CATASTROPHIC.items())
def test_catastrophic_patterns_are_refused_with_the_reason(pattern: str, why: str) -> None:
    problem = pattern_problem(pattern)
    assert problem is not None and problem.startswith("is refused: ") and why in problem


@pytest.mark.parametrize(("pattern", "why"), CATASTROPHIC.items())
def test_config_json_refusal_names_file_key_path_pattern_reason_and_fix(tmp_path: Path, pattern: str, why: str) -> None:
    group = {"targets": ["Linear", "re:.*q_proj$", "re:" + pattern], "weights": NVFP4, "format": "nvfp4-pack-quantized"}
    quant = {"quant_method": "compressed-tensors", "config_groups": {"group_0": group}, "ignore": ["lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quant}))
    with pytest.raises(CheckpointError) as caught:
        read_producer_config(tmp_path)
    message = str(caught.value)
    assert message.startswith(f"{tmp_path / 'config.json'}: quantization_config.config_groups.group_0.targets[2]: ")
    assert repr("re:" + pattern) in message and why in message
    assert "write a flat pattern" in message


def test_a_refused_ignore_entry_names_its_index(tmp_path: Path) -> None:
    group = {"targets": ["Linear"], "weights": NVFP4, "format": "nvfp4-pack-quantized"}
    quant = {"quant_method": "compressed-tensors", "config_groups": {"group_0": group}, "ignore": ["re:(a+)+b"]}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quant}))
    with pytest.raises(
        CheckpointError, match=r"config.json: quantization_config.ignore\[0\]: 're:\(a\+\)\+b' is refused"
    ):
        read_producer_config(tmp_path)


@pytest.mark.parametrize("pattern", ["(" * 5000 + ")" * 5000, "a{99999999999}"])
def test_unusable_patterns_are_refused_not_crashed(pattern: str) -> None:
    problem = pattern_problem(pattern)
    assert problem is not None and "regular expression" in problem


def test_detect_refuses_a_catastrophic_target_of_a_hand_built_config() -> None:
    group = ConfigGroup("group_0", ("re:(a+)+x$",), NVFP4, None, None, "nvfp4-pack-quantized")
    config = CompressedTensorsConfig("config.json", (group,), (), None, None, None, None)
    file = Path("model.safetensors")
    tensors = {"model.layers.0.q_proj.weight": TensorInfo("model.layers.0.q_proj.weight", "float32", (4, 4), file)}
    with pytest.raises(CheckpointError, match=r"target or ignore entry 're:\(a\+\)\+x\$' is refused: it nests"):
        detect(config, tensors, list(load_catalog()))


@pytest.mark.parametrize("piece", [".*_", "[\\w.]*_", "(?:.*_)"])
def test_the_worst_accepted_pattern_stays_fast_on_the_longest_name_read(piece: str) -> None:
    """The allowed worst case (every repeat gives characters back and the match fails at the
    end) on a name of MAX_NAME_LENGTH characters: ~30 ms; three repeats took 0.4-3 s."""
    pattern = piece * MAX_BACKTRACKING_REPEATS + "x$"
    assert pattern_problem(pattern) is None
    assert pattern_problem(piece * (MAX_BACKTRACKING_REPEATS + 1) + "x$") is not None
    compiled = compile_pattern("re:" + pattern)
    start = time.perf_counter()
    for name in ("model." + "_" * (MAX_NAME_LENGTH - 6), "_" * MAX_NAME_LENGTH):
        assert compiled.match(name) is None
    assert time.perf_counter() - start < 1.0


ATOMS = st.sampled_from(["a", "b", ".", r"\.", r"\d", r"\w", "[ab]", "[^.]", "a.", "ab"])
QUANTIFIERS = st.sampled_from(["*", "+", "?", "{2}", "{1,3}", "*?"])


def _regexes(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.one_of(
        st.tuples(children, QUANTIFIERS).map(lambda part: f"(?:{part[0]}){part[1]}"),
        st.lists(children, min_size=2, max_size=3).map("".join),
        st.lists(children, min_size=2, max_size=3).map(lambda parts: "(?:" + "|".join(parts) + ")"),
    )


@settings(max_examples=400, derandomize=True, database=None, deadline=None)
@given(st.recursive(ATOMS, _regexes, max_leaves=8))
def test_every_accepted_pattern_matches_hostile_names_quickly(body: str) -> None:
    """Random patterns, anchored at the end so that a hostile name fails late: whatever the
    check accepts never backtracks catastrophically."""
    pattern = body + "$"
    if pattern_problem(pattern) is not None:
        return
    compiled = re.compile(pattern)
    start = time.perf_counter()
    for unit in ("a", "ab", "a.", "1.", "a1_."):
        compiled.match(unit * (MAX_NAME_LENGTH // len(unit) - 1) + "!")
    assert time.perf_counter() - start < 1.0, pattern


@settings(max_examples=150, derandomize=True, database=None, deadline=None)
@given(st.lists(st.sampled_from([*PUBLISHED, r"model\.layers\.1\..*", r".*experts\.17\..*", r"lm_head"]), max_size=6))
def test_the_joined_pattern_matches_exactly_when_one_entry_does(patterns: list[str]) -> None:
    entries = ["re:" + pattern for pattern in patterns] + ["Linear", "lm_head"]
    joined = any_of(entries, compile_entries(entries, {}))
    for name in NAMES:
        expected = any(re.match(pattern, name) for pattern in patterns)
        if joined is None:  # a global flag such as (?i): entries are matched one by one
            assert any("(?i)" in pattern for pattern in patterns)
            continue
        assert bool(joined.match(name)) == expected, (patterns, name)


def test_hundreds_of_patterns_against_thousands_of_modules_stay_quick() -> None:
    """300 re: ignore entries (none matching) and regex targets, 2,800 quantized modules."""
    file = Path("model.safetensors")
    tensors: dict[str, TensorInfo] = {}
    modules = [f"model.layers.{i}.mlp.experts.{e}.{p}" for i in range(20) for e in range(40) for p in ("up", "down")]
    modules += [f"model.layers.{i}.self_attn.{p}_proj" for i in range(20) for p in "qkvo"] * 1
    for module in modules:
        for short, dtype, shape in (
            ("weight_packed", "uint8", (32, 32)),
            ("weight_scale", "float8_e4m3fn", (32, 4)),
            ("weight_global_scale", "float32", (1,)),
        ):
            tensors[f"{module}.{short}"] = TensorInfo(f"{module}.{short}", dtype, shape, file)
    ignore = [rf"re:.*layers\.{i % 20}\.mlp\.shared_expert_{i}\.(gate|up)$" for i in range(300)]
    targets = (r"re:.*experts\.\d+\.(up|down)$", r"re:.*self_attn\.[qkvo]_proj$")
    group = ConfigGroup("group_0", targets, NVFP4, None, None, "nvfp4-pack-quantized")
    config = CompressedTensorsConfig("config.json", (group,), tuple(ignore), "nvfp4-pack-quantized", None, None, None)
    start = time.perf_counter()
    detection = detect(config, tensors, list(load_catalog()))
    elapsed = time.perf_counter() - start
    assert len(detection.modules) == len(modules) and not detection.ignored
    assert elapsed < 10.0, f"{elapsed:.1f} s"  # ~0.3 s on one core; generous for a busy CI machine


def test_each_pattern_of_a_config_is_checked_once_however_many_there_are(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """6,000 distinct re: entries (more than any per-process cache held), some written twice:
    reading the config checks each once and detection checks none again."""
    checked: list[str] = []

    def counting(pattern: str) -> str | None:
        checked.append(pattern)
        return pattern_problem(pattern)

    monkeypatch.setattr(patterns, "pattern_problem", counting)
    targets = [r"re:.*q_proj$"] + [rf"re:model\.layers\.{i}\.mlp\.x_proj$" for i in range(6000)]
    ignore = [rf"re:model\.layers\.{i}\.mlp\.x_proj$" for i in range(100)] + ["re:.*lm_head$"]
    group = {"targets": targets, "weights": NVFP4, "format": "nvfp4-pack-quantized"}
    quant = {"quant_method": "compressed-tensors", "config_groups": {"group_0": group}, "ignore": ignore}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quant}))
    config = read_producer_config(tmp_path)
    assert len(checked) == len(set(targets) | set(ignore)) == 6002
    file = Path("model.safetensors")
    tensors = {
        f"model.layers.{i}.self_attn.{p}.weight": TensorInfo(
            f"model.layers.{i}.self_attn.{p}.weight", "float32", (4, 4), file
        )
        for i in range(8)
        for p in ("q_proj", "k_proj")
    }
    detection = detect(config, tensors, list(load_catalog()))
    assert len(checked) == 6002
    assert len(detection.modules) == 8 and len(detection.unused_targets) == 6000


# Shapes of long patterns; each grows with the length (the old check sliced the rest of a
# sequence at every item and rescanned nullable runs: quadratic in all of these).
LONG_PATTERNS = {
    "literal": lambda n: "a" * n,
    "escaped dots": lambda n: "model\\." + "x\\." * (n // 3),
    "optional characters": lambda n: "a?" * (n // 2),
    "character classes": lambda n: "[a-z]" * (n // 5),
    "groups": lambda n: "(a)" * (n // 3),
    "choices": lambda n: "|".join(f"x{i}" for i in range(n // 6)),
    "repeated choice": lambda n: "(?:" + "|".join(f"x{i}" for i in range(n // 7)) + ")*",
    "fixed repeats": lambda n: "(?:a{2}b)" * (n // 9),
    "nested groups": lambda n: "(?:a(?:b(?:c)?)?)?" * (n // 18),
}


@pytest.mark.parametrize("shape", list(LONG_PATTERNS))
@pytest.mark.slow  # times patterns thousands of characters long
def test_the_check_is_linear_in_the_pattern_length(shape: str) -> None:
    """Work counted, not timed: items looked at per character stay bounded from 1,000 to 100,000
    characters (a quadratic check would look at ~100x more per character at the long end)."""
    build = LONG_PATTERNS[shape]
    per_character = {}
    for length in (1_000, 10_000, 100_000):
        pattern = build(length)
        per_character[length] = patterns.check_steps(pattern) / len(pattern)
    assert per_character[1_000] > 0
    assert max(per_character.values()) <= 4.0, per_character
    assert per_character[100_000] <= 1.5 * per_character[1_000] + 0.1, per_character


@pytest.mark.slow  # times patterns thousands of characters long
def test_a_long_pattern_gets_the_same_verdict_as_before() -> None:
    """The linear check keeps the verdicts: the follow sets it works out in one pass are the ones
    the rest of each sequence gives."""
    assert pattern_problem("a?" * 50_000) is not None  # 50,000 optional characters can give back
    assert pattern_problem("(?:a?a)" * 20_000) is not None  # each a? can give its 'a' to the next
    assert pattern_problem("(?:a?b)" * 20_000) is None  # an 'a' never matches what follows a?
    assert pattern_problem("model\\." + "x\\." * 30_000 + ".*q_proj$") is None
    assert pattern_problem("(?:(?:\\d+\\.)+){2}") is not None  # nested variable-length repeat


def test_ignored_by_checks_an_entry_it_was_not_given_compiled() -> None:
    """The writer's --ignore matcher: a re: entry missing from ``compiled`` is checked before it
    runs, so '(a+)+' against a long name is refused at once instead of taking minutes."""
    from qscheme.checkpoint.detect import ignored_by

    with pytest.raises(CheckpointError, match="nests a variable-length repeat"):
        ignored_by("model." + "a" * 28 + "!", ["re:model\\.(a+)+$"], {})
    assert ignored_by("model.layers.0.mlp.gate", ["lm_head", "re:.*mlp\\.gate$"], {}) == "re:.*mlp\\.gate$"
    assert ignored_by("model.layers.0.mlp.gate", ["*.mlp.gate"], {}) == "*.mlp.gate"
    assert ignored_by("lm_head", ["lm_head"], {}) == "lm_head"


def test_ignored_by_refuses_a_name_longer_than_any_module_name() -> None:
    from qscheme.checkpoint.detect import ignored_by

    with pytest.raises(CheckpointError, match=f"at most {MAX_NAME_LENGTH:,} characters"):
        ignored_by("a" * (MAX_NAME_LENGTH + 1), ["re:.*a.*b$"], {})
