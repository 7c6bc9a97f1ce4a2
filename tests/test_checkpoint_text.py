"""Untrusted text from checkpoints: escaping, bounds, listings and grouped problems; the load
report and the progress bar that show it."""

from __future__ import annotations

import io
import unicodedata

import pytest

from qscheme.checkpoint.plan import format_problems
from qscheme.checkpoint.report import CheckpointReport
from qscheme.cli.output import TerminalOutput
from qscheme.storage import Progress
from qscheme.tensor_checks import TensorProblem
from qscheme.text import (
    NAME_LIMIT,
    bounded_problem,
    cut,
    escape,
    listing,
    problem_kind,
    problem_lines,
    shown,
)

HOSTILE = "a\x1b[2Jb\rc\nd\te\x7ff\x85g\u202eh\u2066i\u2028j\udc80k\x00"


def _raw_controls(text: str) -> list[str]:
    """Characters a terminal would act on, or that reorder or hide text."""
    return [c for c in text if unicodedata.category(c) in ("Cc", "Cf", "Cs", "Zl", "Zp")]


@pytest.mark.parametrize(
    ("raw", "escaped"),
    [
        ("\x1b[2J", "\\x1b[2J"),
        ("a\rb", "a\\rb"),
        ("a\nb", "a\\nb"),
        ("a\tb", "a\\tb"),
        ("\x7f\x85\x9b", "\\x7f\\x85\\x9b"),
        ("x\u202eevil", "x\\u202eevil"),  # right-to-left override
        ("\u2066\u2069\u200f\u061c", "\\u2066\\u2069\\u200f\\u061c"),  # bidi isolates and marks
        ("line\u2028sep", "line\\u2028sep"),
        ("lone\udc80", "lone\\udc80"),  # a surrogate, as os.fsdecode makes of a bad byte
        ("\U000e0001tag", "\\U000e0001tag"),
    ],
)
def test_escape_writes_every_non_printable_character_as_an_escape(raw: str, escaped: str) -> None:
    assert escape(raw) == escaped
    assert not _raw_controls(escape(raw))


def test_escape_leaves_printable_text_alone() -> None:
    text = "model.layers.0.mlp.up_proj.weight ünïcode 中文 ✓ back\\slash 'quotes'"
    assert escape(text) == text
    assert escape("a\nb\x1bc", keep="\n") == "a\nb\\x1bc"
    assert escape(escape(HOSTILE)) == escape(HOSTILE)  # escaping is idempotent: safe to apply twice


def test_shown_cuts_a_long_value_and_says_how_much() -> None:
    name = "\x1b" + "x" * 1_000_000 + "\n"
    text = shown(name)
    head, tail = NAME_LIMIT - NAME_LIMIT // 3, NAME_LIMIT // 3
    assert f"... [{1_000_002 - head - tail:,} characters cut] ..." in text
    assert text.startswith("\\x1bxxx") and text.endswith("xx\\n")
    assert len(text) < NAME_LIMIT + 60 and not _raw_controls(text)
    assert shown("short\r") == "short\\r" and shown(42) == "42"
    assert cut("abcdefghij", 6) == "abcd... [4 characters cut] ...ij" and cut("abc", 6) == "abc"


def test_bounded_problem_cuts_each_long_name_where_it_stands() -> None:
    first, second = "a" + "x" * 1_000_000 + "b", "c" + "y" * 50_000 + "d"
    problem = f"model.safetensors: tensor {first!r} clashes with {second!r}; rename one"
    text = bounded_problem(problem, name_limit=300, limit=10_000)
    assert text.startswith("model.safetensors: tensor 'axxx") and text.endswith("yyyd'; rename one")
    assert "xxb' clashes with 'cyy" in text  # both names keep their start and end, quotes included
    assert f"... [{1_000_002 - 300:,} characters cut] ..." in text
    assert f"... [{50_002 - 300:,} characters cut] ..." in text
    assert len(text) < 800
    # the whole message is bounded too, and a short one is left alone
    many = " ".join(f"'{i:04}'" for i in range(5000))
    assert len(bounded_problem(many, name_limit=300, limit=1000)) < 1100
    assert bounded_problem(problem[:200], name_limit=300, limit=1000) == problem[:200]


def test_listing_escapes_every_name_and_counts_the_rest() -> None:
    names = ["ok", "bad\x1b[31m", "x" * 5000, *[f"n{i}" for i in range(1500)]]
    text = listing(names, 3)
    assert text.startswith("ok, bad\\x1b[31m, xxx")
    assert "characters cut" in text and text.endswith(", ... (1,500 more)")
    assert listing(names, 3, sentence=True).endswith(" and 1,500 more")
    assert not _raw_controls(text)


def test_problems_of_one_kind_are_counted_not_repeated() -> None:
    problems = [
        TensorProblem("model.safetensors", f"model.layers.{i}.mlp.up_proj.weight_scale", "expected dtype float8_e4m3fn")
        for i in range(5000)
    ]
    problems.insert(2, TensorProblem("model.safetensors", "lm_head.weight", "missing: the scheme declares it"))
    lines = problem_lines(problems)
    assert lines[:3] == [f"  - {problems[i]}" for i in (0, 1, 3)]
    assert lines[3] == "    ... and 4,997 more like this"
    assert lines[4:] == [f"  - {problems[2]}"]
    # the kind ignores file, tensor and numbers, not the message
    assert problem_kind(problems[0]) == problem_kind(problems[4999]) != problem_kind(problems[2])


def test_problem_lines_bound_the_kinds_and_indent_multi_line_problems() -> None:
    problems = [f"problem kind {chr(65 + i)} in 'tensor{i}'" for i in range(12)] * 2
    lines = problem_lines(problems, per_kind=1, max_kinds=2, rest_hint=" (see inspect)")
    assert lines == [
        "  - problem kind A in 'tensor0'",
        "    ... and 1 more like this",
        "  - problem kind B in 'tensor1'",
        "    ... and 1 more like this",
        "  ... and 20 more problems of 10 other kinds (see inspect)",
    ]
    assert problem_lines(["config.json: bad\nfirst detail\nsecond detail"]) == [
        "  - config.json: bad",
        "    first detail",
        "    second detail",
    ]


def test_format_problems_in_a_load_error_groups_by_kind() -> None:
    problems = [TensorProblem("f.safetensors", f"t{i}", "unexpected for scheme X") for i in range(5000)]
    text = format_problems(problems)
    assert text.splitlines() == [
        "  - f.safetensors: tensor 't0': unexpected for scheme X",
        "  - f.safetensors: tensor 't1': unexpected for scheme X",
        "  - f.safetensors: tensor 't2': unexpected for scheme X",
        "    ... and 4,997 more like this",
    ]


def test_report_render_escapes_checkpoint_strings() -> None:
    report = CheckpointReport(
        path="/ckpt\x1b]0;title\x07",
        producer="evil\rproducer\u202e",
        producer_version="1.0\n9",
        config_file="config.json",
        files=("model.safetensors",),
        total_bytes=0,
        layers=(),
        ignored={},
        plain_tensors=(),
        kv_cache_tensors=(),
        tolerated_tensors=(),
        notes=("a note naming\x1b[2J" + "y" * 10_000,),
    )
    text = report.render()
    assert "checkpoint: /ckpt\\x1b]0;title\\x07" in text
    assert "producer: evil\\rproducer\\u202e 1.0\\n9" in text
    assert "note: a note naming\\x1b[2J" in text and "characters cut" in text
    assert not [c for c in _raw_controls(text) if c != "\n"] and len(text.splitlines()) == 6


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_escapes_the_item_and_writes_its_redraws_as_control() -> None:
    terminal = _Terminal()
    stream = TerminalOutput(terminal, "stderr", required=False)
    with Progress(2, "loading", stream=stream) as bar:  # type: ignore[arg-type]
        assert bar.enabled
        bar.advance(2, item="layer\x1b[2J\n")
    written = terminal.getvalue()
    assert written.startswith("\rloading [") and written.endswith("\r")
    assert "2/2 layer\\x1b[2J\\n" in written and "\x1b" not in written and "\n" not in written
