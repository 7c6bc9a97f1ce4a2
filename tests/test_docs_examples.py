"""Every fenced code block of README.md and docs/*.md is run or checked, so an example cannot rot.

The convention, by the block's info string (its first word is the language, the rest are
attributes):

- ``python``: executed, each block on its own (a fresh namespace), with the working directory
  set to a scratch folder that holds the repository's ``tests``, ``schemes`` and ``examples``
  (linked) and every ``file=`` block of the same page.
- ``yaml``: parsed as YAML. A descriptor (a mapping with ``name`` and ``weight``) must parse as
  a scheme and give back its layer size (``qscheme.descriptor.loadable``), the checks of
  ``qscheme validate`` that do not depend on the catalog. ``invalid`` marks a descriptor shown
  for its errors: it must fail to parse.
- ``console``: each ``$ qscheme ...`` line (optionally preceded by ``VAR=value`` settings) is run
  with the installed ``qscheme`` command in the scratch folder. The lines after it, up to the
  next ``$``, are its expected output (stdout and stderr together); ``...`` alone on a line
  stands for any lines, ``...`` inside a line for any text. ``exit=N`` gives the expected exit
  status of every command of the block (default 0). A ``$`` line that is not a qscheme command
  needs ``no-run``. Commands run as on a fresh install (built-in kernels only, no Triton
  interpreter), unless the block says ``plugins``: then installed third-party plugins load
  (CI installs the example plugin, see .ci/install-example-plugins.sh). Column padding (two
  or more spaces) and table rules (three or more dashes) match any width.
- ``text`` (and any other language, e.g. ``toml``): shown only: output excerpts, grammars.
- ``file=PATH`` (any language): the block is also written to PATH in the scratch folder.
- ``no-run``: shown only, on purpose (e.g. it needs a GPU, a network or a path of the reader's).

A block without an info string fails: say what it is.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from qscheme.descriptor import parse_scheme_text
from qscheme.descriptor.loadable import load_problems
from qscheme.errors import SchemeError

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED = ("tests", "schemes", "examples")
RUN_LANGUAGES = ("python", "yaml", "console")
SHOWN_LANGUAGES = ("text", "toml", "json", "bash", "sh", "shell")
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+)(?P<info>.*)$")
ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence
    language: str
    attributes: dict[str, str] = field(default_factory=dict)
    text: str = ""

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    """The fenced blocks of a Markdown page (indented ones in list items too), in order."""
    blocks: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        words = opening["info"].split()
        body: list[str] = []
        index += 1
        while index < len(lines) and lines[index].strip() != fence:
            body.append(lines[index][indent:] if lines[index][:indent].strip() == "" else lines[index])
            index += 1
        attributes = dict(word.split("=", 1) if "=" in word else (word, "") for word in words[1:])
        start = index - len(body)
        blocks.append(Block(page, start, words[0] if words else "", attributes, "\n".join(body) + "\n"))
        index += 1
    return blocks


ALL_BLOCKS = [block for page in PAGES for block in blocks_of(page)]


@pytest.fixture
def scratch(tmp_path: Path, block: Block) -> Path:
    """A working folder for one block: the repository's data linked, the page's file= blocks written."""
    for name in LINKED:
        (tmp_path / name).symlink_to(ROOT / name)
    for other in blocks_of(block.page):
        target = other.attributes.get("file")
        if target:
            path = tmp_path / target
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(other.text, encoding="utf-8")
    return tmp_path


def test_the_pages_have_examples() -> None:
    """The collector sees the blocks (a broken fence pattern would silently test nothing)."""
    assert len(ALL_BLOCKS) >= 20
    assert {block.language for block in ALL_BLOCKS} >= {"python", "yaml"}


def test_every_block_says_what_it_is() -> None:
    unlabelled = [block.where for block in ALL_BLOCKS if not block.language]
    assert not unlabelled, (
        "fenced blocks without an info string (write ```python, ```yaml or ```console to have them run, "
        f"```text for output excerpts; see tests/test_docs_examples.py): {', '.join(unlabelled)}"
    )


@pytest.mark.parametrize(
    "block",
    [
        # a console block runs its commands as processes
        pytest.param(b, id=b.where, marks=pytest.mark.subprocess if b.language == "console" else ())
        for b in ALL_BLOCKS
        if b.language in RUN_LANGUAGES and "no-run" not in b.attributes
    ],
)
def test_example(block: Block, scratch: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(scratch)
    if block.language == "python":
        code = compile(block.text, block.where, "exec")
        exec(code, {"__name__": "__doc_example__"})
    elif block.language == "yaml":
        check_yaml(block)
    else:
        check_console(block, scratch)


def check_yaml(block: Block) -> None:
    data = yaml.safe_load(block.text)
    if not (isinstance(data, dict) and "name" in data and "weight" in data):
        assert "invalid" not in block.attributes, f"{block.where}: 'invalid' marks descriptors only"
        return
    if "invalid" in block.attributes:
        with pytest.raises(SchemeError):
            parse_scheme_text(block.text, block.where)
        return
    scheme = parse_scheme_text(block.text, block.where)
    assert load_problems(scheme) == [], f"{block.where}: no checkpoint of this descriptor would load"


def commands_of(block: Block) -> list[tuple[str, list[str]]]:
    """(command line, expected output lines) for each ``$`` line of a console block."""
    commands: list[tuple[str, list[str]]] = []
    for line in block.text.splitlines():
        if line.startswith("$ "):
            commands.append((line[2:], []))
        elif commands:
            commands[-1][1].append(line)
        elif line.strip():
            raise AssertionError(f"{block.where}: output before the first '$ ' command: {line!r}")
    assert commands, f"{block.where}: a console block runs '$ qscheme ...' lines; mark output excerpts ```text"
    return commands


def check_console(block: Block, scratch: Path) -> None:
    executable = Path(sys.executable).parent / "qscheme"
    assert executable.exists(), f"the qscheme command is not installed next to {sys.executable}"
    expected_status = int(block.attributes.get("exit", "0"))
    for command, expected in commands_of(block):
        words = shlex.split(command, comments=True)
        settings = {}
        while words and ASSIGNMENT.match(words[0]):
            name, value = words.pop(0).split("=", 1)
            settings[name] = value
        assert words and words[0] == "qscheme", (
            f"{block.where}: {command!r} is not a qscheme command: mark the block no-run, or show it as ```text"
        )
        # as a reader's shell on a fresh install: built-in kernels only, and no Triton interpreter
        # (the suite's TRITON_INTERPRET would put the Triton kernel on the CPU), unless the page says so
        env = {key: value for key, value in os.environ.items() if not key.startswith(("QSCHEME_", "TRITON_"))}
        if "plugins" not in block.attributes:  # ``plugins``: the example plugins CI installs are loaded
            env["QSCHEME_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        env.update(settings)
        done = subprocess.run(
            [str(executable), *words[1:]],
            cwd=scratch,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=300,
            check=False,
        )
        output = "".join(line.rstrip() + "\n" for line in done.stdout.splitlines())
        assert done.returncode == expected_status, (
            f"{block.where}: `{command}` exited {done.returncode}, the page says {expected_status}:\n{output}"
        )
        if expected and any(line.strip() for line in expected):
            assert matches(expected, output), (
                f"{block.where}: `{command}` printed\n{output}\nwhich does not match the page's\n" + "\n".join(expected)
            )


def matches(expected: list[str], output: str) -> bool:
    """Whether ``output`` is ``expected`` line by line, ``...`` being a wildcard (module docstring)."""
    parts = []
    for line in expected:
        line = line.rstrip()
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(".*?".join(_literal(piece) for piece in line.split("...")) + r"\n")
    return re.fullmatch("".join(parts), output) is not None


def _literal(text: str) -> str:
    """``text`` as a regex, except that a table's column padding (two or more spaces) and rules
    (three or more dashes) match any width: columns widen with what they hold (timings)."""
    pieces = re.split(r"( {2,}|-{3,})", text)
    return "".join(
        " {2,}" if piece.startswith("  ") else "-{3,}" if piece.startswith("---") else re.escape(piece)
        for piece in pieces
    )


def test_the_matcher_is_strict() -> None:
    assert matches(["a", "...", "c"], "a\nb\nb\nc\n")
    assert matches(["a", "...", "c"], "a\nc\n")
    assert matches(["torch ..., ok"], "torch 2.1, ok\n")
    assert not matches(["a", "c"], "a\nb\nc\n")
    assert not matches(["a"], "a\nextra\n")
    assert not matches(["torch ..., ok"], "torch 2.1, failed\n")
    assert matches(["a", "  ...", "c"], "a\n  b\nc\n")
    # table columns widen with their contents; the words and their order still count
    assert matches(["ms     ok", "-----  --"], "ms      ok\n------  --\n")
    assert not matches(["ms  ok"], "ms ok\n")
    assert not matches(["ms  ok"], "ms  failed\n")
    assert not matches(["---  --"], "---  -\n")


def test_blocks_are_found_with_their_attributes(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "x\n```yaml file=a/b.yaml invalid\nname: x\n```\n- item\n  ```console exit=1\n  $ qscheme x\n  ```\n"
    )
    first, second = blocks_of(page)
    assert (first.language, first.attributes, first.text, first.line) == (
        "yaml",
        {"file": "a/b.yaml", "invalid": ""},
        "name: x\n",
        2,
    )
    assert (second.language, second.attributes, second.text) == ("console", {"exit": "1"}, "$ qscheme x\n")
