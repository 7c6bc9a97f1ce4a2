"""An empty checkpoint path is a usage error (exit 2), never the current folder.

``Path("")`` is ``.``: before, ``qscheme inspect ""`` (an unset shell variable) inspected
whatever folder the command ran in. Run here from inside a valid checkpoint folder, where the
current folder would have been inspected, resolved and run without complaint.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from checkpoint_cache import modelopt_fixture

from qscheme.checkpoint import load_checkpoint
from qscheme.checkpoint.inspect import inspect_checkpoint
from qscheme.cli.main import main
from qscheme.errors import UsageError
from qscheme.storage import CheckpointFiles

MESSAGE = "is empty (''), which would name the current folder"


@pytest.fixture
def inside_a_checkpoint(monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = modelopt_fixture("nvfp4_exclude")
    monkeypatch.chdir(folder)
    return folder


@pytest.mark.parametrize("command", ["inspect", "run", "resolve"])
def test_an_empty_checkpoint_argument_exits_2(
    command: str, inside_a_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([command, ""]) == 2
    captured = capsys.readouterr()
    assert MESSAGE in captured.err
    assert captured.out == ""


def test_inspect_json_reports_the_usage_error(inside_a_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "", "--json"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["type"] == "UsageError" and error["exit_code"] == 2 and MESSAGE in error["message"]


def test_a_dot_still_names_the_current_folder(inside_a_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "."]) == 0  # the explicit spelling the message suggests


def test_the_library_refuses_an_empty_path_too(inside_a_checkpoint: Path) -> None:
    """Like a bad fuse=, an empty path is the caller's mistake: raised, not listed as a problem."""
    for call in (load_checkpoint, CheckpointFiles, inspect_checkpoint):
        with pytest.raises(UsageError, match=re.escape(MESSAGE)):
            call("")
