"""`qscheme` entry point: --version, help epilog, exit codes, --json errors and output errors."""

from __future__ import annotations

import errno
import json
import os
import shlex
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from kernel_fakes import isolated_plugins

from qscheme.cli.main import main
from qscheme.cli.output import finite, print_json
from qscheme.plugins import Plugins, hookimpl

VARIABLES = (
    "QSCHEME_SCHEME_PATH",
    "QSCHEME_KERNEL",
    "QSCHEME_DISABLED_KERNELS",
    "QSCHEME_PLUGINS",
    "QSCHEME_STRICT_PLUGINS",
    "QSCHEME_DISABLE_PLUGIN_AUTOLOAD",
)


@pytest.fixture(autouse=True)
def builtins_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[Plugins]:
    for name in ("QSCHEME_KERNEL", "QSCHEME_DISABLED_KERNELS", "QSCHEME_SCHEME_PATH"):
        monkeypatch.delenv(name, raising=False)
    with isolated_plugins() as plugins:
        assert isinstance(plugins, Plugins)
        yield plugins


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from qscheme import __version__

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"qscheme {__version__}"


def test_help_lists_exit_codes_and_environment(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "exit codes:" in out and "2  usage or input error" in out
    for variable in VARIABLES:
        assert variable in out


@pytest.mark.parametrize(
    "argv",
    [
        ["show", "no/such-scheme"],
        ["show", "missing.yaml"],
        ["resolve", "no/such-scheme"],
        ["run", "no-such-folder"],
        ["inspect", "no-such-folder"],
        ["run", "{file}"],
    ],
)
def test_input_that_cannot_be_found_exits_2(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "file.txt"
    file.write_text("not a checkpoint")
    code, _, err = run([a.format(file=file) for a in argv], capsys)
    assert code == 2 and "Traceback" not in err
    assert err.startswith(f"qscheme {argv[0]}: error: ")


def test_json_errors_are_json_on_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["show", "no/such-scheme", "--json"], capsys)
    assert code == 2 and "unknown scheme 'no/such-scheme'" in err
    error = json.loads(out)["error"]
    assert error["type"] == "SchemeNotFoundError" and error["exit_code"] == 2
    assert "unknown scheme 'no/such-scheme'" in error["message"]
    code, out, _ = run(["run", "no-such-folder", "--json"], capsys)
    assert code == 2 and json.loads(out)["error"]["type"] == "CheckpointNotFoundError"


def test_json_argument_errors_are_json_on_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["run", "folder", "--rows", "many", "--json"])
    captured = capsys.readouterr()
    assert info.value.code == 2 and "invalid int value: 'many'" in captured.err
    assert json.loads(captured.out) == {
        "error": {"type": "UsageError", "message": "argument --rows: invalid int value: 'many'", "exit_code": 2}
    }


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--rows", "0"], "--rows 0: must be between 1 and 65536"),
        (["--rows", "65537"], "--rows 65537: must be between 1 and 65536"),
        (["--tolerance", "nan"], "--tolerance nan: must be a finite number > 0"),
        (["--tolerance", "inf"], "--tolerance inf: must be a finite number > 0"),
        (["--tolerance", "-1"], "--tolerance -1: must be a finite number > 0"),
        (["--tolerance", "0"], "--tolerance 0: must be a finite number > 0"),
        (["--device", "cpux"], "needs a real device"),
    ],
)
def test_run_options_are_checked_before_anything_is_read(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(["run", "no-such-folder", *extra], capsys)  # the folder is checked later
    assert code == 2 and message in err


def test_json_never_holds_nan_or_infinity(capsys: pytest.CaptureFixture[str]) -> None:
    value = {"a": float("nan"), "b": [float("inf"), -float("inf"), 1.5], "c": (2.0, "x")}
    assert finite(value) == {"a": None, "b": [None, None, 1.5], "c": [2.0, "x"]}
    print_json(value)
    assert json.loads(capsys.readouterr().out) == {"a": None, "b": [None, None, 1.5], "c": [2.0, "x"]}


class _FailingPlugin:
    @hookimpl
    def qscheme_kernels(self) -> list[object]:
        raise RuntimeError("broken on purpose")


class _PrintingPlugin:
    @hookimpl
    def qscheme_kernels(self) -> list[object]:
        print("HELLO FROM A PLUGIN")
        return []


def test_plugins_exits_1_when_a_plugin_failed(builtins_only: Plugins, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, _ = run(["plugins"], capsys)
    assert code == 0
    builtins_only.register(_FailingPlugin(), "failing")
    code, out, _ = run(["plugins"], capsys)
    assert code == 1 and "broken on purpose" in out and "1 error(s)" in out
    code, out, _ = run(["plugins", "--json"], capsys)
    assert code == 1 and any(p["name"] == "failing" for p in json.loads(out))


def test_plugin_prints_do_not_corrupt_json(builtins_only: Plugins, capsys: pytest.CaptureFixture[str]) -> None:
    builtins_only.register(_PrintingPlugin(), "printing")
    code, out, err = run(["kernels", "--device", "cpu", "--json"], capsys)
    assert code == 0 and "HELLO FROM A PLUGIN" in err
    assert {"reference"} <= {record["name"] for record in json.loads(out)}


def test_unknown_kernel_from_the_environment_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("QSCHEME_KERNEL", "refrence")
    code, _, err = run(["resolve", "compressed-tensors/W4A16"], capsys)
    assert code == 2
    assert "QSCHEME_KERNEL='refrence' names no declared kernel; did you mean 'reference'?" in err
    assert "fix or unset QSCHEME_KERNEL" in err
    code, out, _ = run(["resolve", "compressed-tensors/W4A16", "--kernel", "reference", "--device", "cpu"], capsys)
    assert code == 0 and out.startswith("kernel: reference (forced)")  # --kernel wins over the variable


class _FullDisk:
    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_write_errors_are_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "stdout", _FullDisk())
    assert main(["schemes"]) == 1
    assert capsys.readouterr().err == "qscheme schemes: error: cannot write output: No space left on device\n"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.subprocess
def test_a_full_disk_exits_1_without_a_traceback() -> None:
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "qscheme.cli.main", "schemes"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            env={**os.environ, "QSCHEME_DISABLE_PLUGIN_AUTOLOAD": "1"},
        )
    assert done.returncode == 1
    assert done.stderr == "qscheme schemes: error: cannot write output: No space left on device\n"


NOISY_SITE = Path(__file__).parent / "data" / "noisy_plugin"


def _qscheme(shell_arguments: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run `qscheme ARGUMENTS` through sh, so that redirections such as `>&-` apply as typed."""
    return subprocess.run(
        ["sh", "-c", f'exec "$0" -m qscheme.cli.main {shell_arguments}', sys.executable],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "QSCHEME_DISABLE_PLUGIN_AUTOLOAD": "1", **env},
    )


def test_help_says_what_a_closed_output_exits_with(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "a closed stdout, a pipe closed early as in `qscheme schemes | head -1`" in out
    assert "A stderr that cannot be written (2>&-) does not change the exit code." in out
    readme = " ".join((Path(__file__).parents[1] / "README.md").read_text().split())
    assert "its output could not be written (a full disk, a closed stdout, a pipe closed early)" in readme


@pytest.mark.subprocess
def test_a_closed_stdout_exits_1_with_one_line() -> None:
    done = _qscheme("kernels --device cpu >&-")
    assert done.returncode == 1
    assert done.stderr == "qscheme kernels: error: cannot write output: stdout is closed\n"
    done = _qscheme("schemes --json >&-")
    assert (done.returncode, done.stderr) == (1, "qscheme schemes: error: cannot write output: stdout is closed\n")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize(
    ("redirected", "reason"),
    [
        ("--help >/dev/full", "No space left on device"),
        ("run --help >/dev/full", "No space left on device"),
        ("--version >/dev/full", "No space left on device"),
        ("--version >&-", "stdout is closed"),
        ("--help >&-", "stdout is closed"),
    ],
)
@pytest.mark.subprocess
def test_help_and_version_obey_the_output_rule(redirected: str, reason: str) -> None:
    """argparse prints them itself and ignores write errors (or falls back to stderr)."""
    done = _qscheme(redirected)
    assert (done.returncode, done.stderr) == (1, f"qscheme: error: cannot write output: {reason}\n")


def _into_a_closed_pipe(arguments: list[str]) -> subprocess.CompletedProcess[str]:
    """``qscheme ARGUMENTS`` writing into a pipe whose reader has already gone."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "qscheme.cli.main", *arguments],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            env={**os.environ, "QSCHEME_DISABLE_PLUGIN_AUTOLOAD": "1"},
        )
    finally:
        os.close(write_end)


@pytest.mark.parametrize("arguments", [["--help"], ["--version"]])
@pytest.mark.subprocess
def test_help_and_version_into_a_closed_pipe_exit_1_silently(arguments: list[str]) -> None:
    done = _into_a_closed_pipe(arguments)
    assert (done.returncode, done.stderr) == (1, "")
    done = _qscheme(" ".join(arguments))
    assert done.returncode == 0 and done.stdout.startswith(("usage: qscheme", "qscheme ")) and done.stderr == ""


@pytest.mark.subprocess
def test_a_closed_stderr_keeps_the_commands_exit_code(tmp_path: Path) -> None:
    done = _qscheme(f"inspect {tmp_path / 'missing'} 2>&-")
    assert (done.returncode, done.stdout, done.stderr) == (2, "", "")
    done = _qscheme("schemes 2>&-")
    assert done.returncode == 0 and done.stdout.splitlines()[0].startswith("scheme ")


@pytest.mark.parametrize("arguments", [["schemes"], ["schemes", "--json"], ["kernels", "--device", "cpu"]])
@pytest.mark.subprocess
def test_a_pipe_closed_by_its_reader_exits_1_silently(arguments: list[str]) -> None:
    """`qscheme schemes | head -1` once head has exited: the pipe has no reader left."""
    done = _into_a_closed_pipe(arguments)
    assert (done.returncode, done.stderr) == (1, "")


@pytest.mark.parametrize("command", ["kernels --device cpu --json", "plugins --json"])
@pytest.mark.subprocess
def test_plugin_prints_never_reach_stdout_in_json_mode(command: str) -> None:
    done = _qscheme(
        command,
        PYTHONPATH=f"{NOISY_SITE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        QSCHEME_DISABLE_PLUGIN_AUTOLOAD="",
        QSCHEME_PLUGINS="noisy",
    )
    assert done.returncode == 0, done.stderr
    records = json.loads(done.stdout)
    if command.startswith("plugins"):
        assert any(record["name"] == "noisy" and record["loaded"] for record in records)
    for line in ("NOISY PLUGIN IMPORTED", "NOISY PLUGIN NATIVE WRITE", "NOISY PLUGIN HOOK NATIVE WRITE"):
        assert line in done.stderr
    assert "NOISY PLUGIN HOOK \\x1b[2J" in done.stderr  # escaped there too


FIXTURE = Path(__file__).parent / "fixtures" / "modelopt" / "nvfp4"


@pytest.mark.parametrize(
    ("command", "code"),
    [
        ("resolve {fixture}", 0),
        ("resolve {fixture} --json", 0),
        ("run {fixture} --kernel reference --rows 1 --json", 0),
        ("inspect {fixture}", 0),
        ("plugins --json", 0),
        ("show modelopt/FP8 --json", 0),
        ("schemes --json", 1),
    ],
)
@pytest.mark.subprocess
def test_a_skipped_descriptor_is_one_warning_line_on_stderr(command: str, code: int, tmp_path: Path) -> None:
    (tmp_path / "broken.yaml").write_text("name: acme/broken\nweight: 3\n")
    done = _qscheme(command.format(fixture=shlex.quote(str(FIXTURE))), QSCHEME_SCHEME_PATH=str(tmp_path))
    assert done.returncode == code, done.stderr
    expected = f"warning: skipped {tmp_path / 'broken.yaml'}:2:9: weight: 3 is not a mapping; "
    assert done.stderr.startswith(expected) and done.stderr.count("warning: ") == 1, done.stderr
    assert "SchemePathWarning" not in done.stderr and "catalog.py" not in done.stderr
    assert "(the other schemes load; QSCHEME_STRICT_SCHEMES=1 makes this an error)\n" in done.stderr
    assert "warning" not in done.stdout
    if "--json" in command:
        json.loads(done.stdout)


def test_qscheme_warnings_are_one_line_once_and_others_untouched(capsys: pytest.CaptureFixture[str]) -> None:
    from qscheme.catalog import SchemePathWarning
    from qscheme.cli.main import qscheme_warnings
    from qscheme.modules import KernelRouteWarning

    with pytest.warns(UserWarning, match="not ours") as record, qscheme_warnings():
        for _ in range(2):
            warnings.warn("layer x: float32 inputs run on kernel 'reference'", KernelRouteWarning, stacklevel=1)
            warnings.warn("skipped a.yaml: broken", SchemePathWarning, stacklevel=1)
        warnings.warn("skipped a.yaml: broken", SchemePathWarning, stacklevel=1)  # another line, same message
        warnings.warn("not ours", UserWarning, stacklevel=1)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert (
        captured.err == "warning: layer x: float32 inputs run on kernel 'reference'\nwarning: skipped a.yaml: broken\n"
    )
    assert [w.category for w in record] == [UserWarning]  # a warning not qscheme's is shown as Python shows it
