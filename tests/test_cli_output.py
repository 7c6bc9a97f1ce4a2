"""The command's output streams: escaped, bounded text; bounded error messages; closed streams;
and what `qscheme inspect` / `qscheme run` show of a checkpoint with hostile tensor names."""

from __future__ import annotations

import io
import json
import unicodedata
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kernel_fakes import isolated_plugins
from safetensors.torch import load_file, save_file

from qscheme.cli.main import main
from qscheme.cli.output import LINE_LIMIT, GuardedOutput, TerminalOutput, bounded_message
from qscheme.errors import OutputError
from qscheme.examples.make_checkpoint import make_checkpoint

EVIL = "evil\x1b[2J\r\nname\u202eX"
LONG = "a.plain." + "A" * 1000  # as long as a tensor name may be (the loader refuses longer ones)
REPEATS = 5000


def _raw_controls(text: str) -> list[str]:
    """Characters a terminal would act on (but the newline), or that reorder or hide text."""
    return [c for c in text if c != "\n" and unicodedata.category(c) in ("Cc", "Cf", "Cs", "Zl", "Zp")]


def test_terminal_output_escapes_all_but_its_own_newlines() -> None:
    sink = io.StringIO()
    out = TerminalOutput(sink)
    out.write("row 1: \x1b[2J\r\u202e\n")
    out.write("partial \x07")
    assert sink.getvalue() == "row 1: \\x1b[2J\\r\\u202e\n"  # a partial line waits for its newline
    out.write(" done\nlast")
    out.flush()
    assert sink.getvalue() == "row 1: \\x1b[2J\\r\\u202e\npartial \\x07 done\nlast"
    out.write_control("\r[###]")
    assert sink.getvalue().endswith("last\r[###]")


def test_terminal_output_bounds_every_line() -> None:
    sink = io.StringIO()
    TerminalOutput(sink, line_limit=100).write("start" + "z" * 10_000 + "end\nshort\n")
    first, second, _ = sink.getvalue().split("\n")
    assert first.startswith("start") and first.endswith("end") and "[9,908 characters cut]" in first
    assert len(first) < 150 and second == "short"


def test_a_closed_stdout_is_an_output_error_and_a_closed_stderr_is_ignored() -> None:
    with pytest.raises(OutputError, match="cannot write output: stdout is closed"):
        GuardedOutput(None).write("x")
    GuardedOutput(None, "stderr", required=False).write("x")  # nowhere to report it: no error

    class Broken(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError

    with pytest.raises(BrokenPipeError):
        GuardedOutput(Broken()).write("x")
    TerminalOutput(Broken(), "stderr", required=False).write("x\n")


def test_bounded_message_counts_repeated_lines_and_caps_lines() -> None:
    lines = ["3 problems:", *[f"  - tensor 'layer.{i}.w': expected dtype int8, found {i}" for i in range(5000)]]
    lines.append("fix: re-export the checkpoint")
    assert bounded_message("\n".join(lines)).splitlines() == [
        "3 problems:",
        "  - tensor 'layer.0.w': expected dtype int8, found 0",
        "  - tensor 'layer.1.w': expected dtype int8, found 1",
        "  - tensor 'layer.2.w': expected dtype int8, found 2",
        "    ... and 4,997 more like this",
        "fix: re-export the checkpoint",
    ]
    distinct = "\n".join(f"line {chr(65 + i % 26)}{chr(65 + i // 26)}" for i in range(500))
    capped = bounded_message(distinct, max_lines=10).splitlines()
    assert len(capped) == 10 and capped[-1] == "... [491 more lines cut]" and capped[0] == "line AA"
    assert "[999,900 characters cut]" in bounded_message("x" * 1_000_000, line_limit=100)


@pytest.fixture(autouse=True)
def builtins_only() -> Iterator[None]:
    with isolated_plugins():
        yield


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid checkpoint plus a plain tensor with a hostile name, one with a long name, and 5,000
    tensors that are each the same problem."""
    folder = make_checkpoint(tmp_path_factory.mktemp("hostile") / "ckpt", layers=1)
    file = next(folder.glob("*.safetensors"))
    tensors = load_file(str(file))
    tensors[EVIL] = torch.zeros(2)
    tensors[LONG] = torch.zeros(1)
    for i in range(REPEATS):
        tensors[f"model.layers.0.mlp.up_proj.extra{i}"] = torch.zeros(1)
    save_file(tensors, str(file))
    return folder


def test_inspect_text_escapes_names_and_groups_problems(hostile: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(hostile)]) == 1
    out = capsys.readouterr().out
    assert not _raw_controls(out)
    assert "evil\\x1b[2J\\r\\nname\\u202eX" in out
    assert f"problems ({REPEATS}):" in out
    assert f"    ... and {REPEATS - 3:,} more like this" in out
    assert out.count("unexpected for scheme") == 3
    assert "characters cut]" in out and max(len(line) for line in out.splitlines()) <= LINE_LIMIT + 40


def test_inspect_json_keeps_the_names_exact_and_caps_the_problems(
    hostile: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(hostile), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert EVIL in data["plain_tensors"] and LONG in data["plain_tensors"]
    assert (len(data["problems"]), data["problem_count"], data["problems_cut"]) == (1000, REPEATS, REPEATS - 1000)
    assert "'model.layers.0.mlp.up_proj.extra0'" in data["problems"][0]  # each listed, not grouped


def test_inspect_json_bounds_a_long_value_in_a_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = make_checkpoint(tmp_path / "ckpt", layers=1)
    config = json.loads((folder / "config.json").read_text())
    fmt = "nvfp4-" + "y" * 1_000_000 + "-end"
    config["quantization_config"]["config_groups"]["group_0"]["format"] = fmt
    (folder / "config.json").write_text(json.dumps(config))
    assert main(["inspect", str(folder), "--json"]) == 1
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert problems and all(len(problem) < 9000 for problem in problems)
    first = problems[0]
    assert first.startswith(f"{folder / 'config.json'}: module ")  # the file and module stay named
    assert "'nvfp4-yyy" in first and "yyy-end'" in first and "characters cut] ..." in first


def test_a_load_error_is_bounded(hostile: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(hostile), "--device", "cpu"]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith(f"qscheme run: error: {hostile}: {REPEATS} problem(s) found, nothing was loaded")
    assert f"... and {REPEATS - 3:,} more like this" in captured.err
    assert len(captured.err) < 10_000 and not _raw_controls(captured.err)
    assert main(["run", str(hostile), "--device", "cpu", "--json"]) == 1
    message = json.loads(capsys.readouterr().out)["error"]["message"]
    assert f"... and {REPEATS - 3:,} more like this" in message and len(message) < 10_000


def test_a_missing_checkpoint_path_is_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "no\x1b[2Jsuch\nfolder"]) == 2
    assert capsys.readouterr().err == (
        "qscheme inspect: error: no\\x1b[2Jsuch\\nfolder: no such folder; "
        "pass a checkpoint folder (config.json + *.safetensors)\n"
    )
