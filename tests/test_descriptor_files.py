"""Reading descriptor files: special files are refused by type before opening; bytes are capped."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from qscheme.descriptor import files, parse_scheme_file
from qscheme.errors import SchemeError


@pytest.fixture
def no_hang() -> Iterator[None]:
    """Fail instead of hanging if a regression opens a FIFO for reading."""

    def expire(signum: int, frame: object) -> None:
        raise AssertionError("reading the descriptor blocked")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_a_fifo_is_refused_without_opening_it(tmp_path: Path, no_hang: None) -> None:
    os.mkfifo(tmp_path / "pipe.yaml")
    with pytest.raises(SchemeError) as info:
        parse_scheme_file(tmp_path / "pipe.yaml")
    assert str(info.value) == (
        f"{tmp_path / 'pipe.yaml'}: is a FIFO (named pipe), not a descriptor file; pass a regular .yaml file"
    )


def test_a_fifo_swapped_in_after_the_check_does_not_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_hang: None
) -> None:
    os.mkfifo(tmp_path / "pipe.yaml")
    monkeypatch.setattr(files, "path_problem", lambda path: None)  # as if it was a regular file when checked
    with pytest.raises(SchemeError, match="is a FIFO"):
        files.read_descriptor_text(tmp_path / "pipe.yaml")


def test_devices_links_and_folders_are_named(tmp_path: Path) -> None:
    (tmp_path / "dangling.yaml").symlink_to(tmp_path / "gone.yaml")
    (tmp_path / "loop.yaml").symlink_to(tmp_path / "loop.yaml")
    cases = {
        "/dev/zero": "is a character device, not a descriptor file",
        str(tmp_path / "dangling.yaml"): f"is a symlink to {str(tmp_path / 'gone.yaml')!r}, which does not exist",
        str(tmp_path / "loop.yaml"): "is a symlink loop; point the link at a real descriptor file",
        str(tmp_path): "is a folder, not a descriptor file",
        str(tmp_path / "absent.yaml"): "does not exist; check the path",
    }
    for path, expected in cases.items():
        with pytest.raises(SchemeError) as info:
            parse_scheme_file(path)
        assert str(info.value).startswith(f"{path}: {expected}")


def test_size_is_capped_by_stat_and_by_the_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (files.MAX_DESCRIPTOR_BYTES + 1))
    with pytest.raises(SchemeError, match=r"is 1048577 bytes; a descriptor is at most 1048576 bytes \(1 MiB\)"):
        parse_scheme_file(big)
    at_cap = tmp_path / "at_cap.yaml"
    at_cap.write_bytes(b"#" * files.MAX_DESCRIPTOR_BYTES)
    assert len(files.read_descriptor_bytes(at_cap)) == files.MAX_DESCRIPTOR_BYTES
    # a file whose stat size says little (as /proc files say 0) is still cut at the cap
    monkeypatch.setattr(files, "path_problem", lambda path: None)
    with pytest.raises(SchemeError, match="is more than 1048576 bytes"):
        files.read_descriptor_bytes(big)


def test_text_must_be_utf8(tmp_path: Path) -> None:
    (tmp_path / "latin.yaml").write_bytes(b"name: caf\xe9\n")
    with pytest.raises(SchemeError, match=r"latin\.yaml: is not UTF-8 text \(byte 9: invalid"):
        parse_scheme_file(tmp_path / "latin.yaml")
