"""The descriptor a self-describing config embeds is capped (256 KiB) and its problems bounded.

config.json comes with a downloaded checkpoint: before, a 20 MB embedded descriptor with a
million unknown keys was parsed in full, and every problem went into the error (minutes, and
hundreds of MB of output).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qscheme.checkpoint.config import read_producer_config
from qscheme.checkpoint.inspect import inspect_checkpoint
from qscheme.descriptor.files import MAX_EMBEDDED_DESCRIPTOR_BYTES
from qscheme.errors import CheckpointError
from qscheme.producers.self_described.detect import EMBEDDED_PROBLEMS_SHOWN, embedded_scheme

SCHEME_FILE = Path(__file__).parents[1] / "schemes" / "compressed-tensors" / "FP8_DYNAMIC.yaml"


def _config(folder: Path, descriptor: str, scheme: str = "compressed-tensors/FP8_DYNAMIC") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = {"quantization_config": {"quant_method": "qscheme", "scheme": scheme, "descriptor": descriptor}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_the_cap_is_256_kib() -> None:
    assert MAX_EMBEDDED_DESCRIPTOR_BYTES == 256 * 1024


def test_a_descriptor_just_under_the_cap_is_read(tmp_path: Path) -> None:
    text = SCHEME_FILE.read_text()
    padded = text + "#" * (MAX_EMBEDDED_DESCRIPTOR_BYTES - len(text.encode()) - 1) + "\n"
    assert len(padded.encode()) == MAX_EMBEDDED_DESCRIPTOR_BYTES
    scheme = embedded_scheme(read_producer_config(_config(tmp_path, padded)))
    assert scheme.name == "compressed-tensors/FP8_DYNAMIC"


@pytest.mark.parametrize(
    "padding",
    [
        "#" * MAX_EMBEDDED_DESCRIPTOR_BYTES,
        "#" + "\u4e2d" * 100_000,  # 100,001 characters, but 300,001 bytes of UTF-8
        "#" * 20_000_000,
    ],
)
def test_a_larger_descriptor_is_refused_before_it_is_parsed(tmp_path: Path, padding: str) -> None:
    text = SCHEME_FILE.read_text() + padding + "\n"
    expected = len(text.encode())
    with pytest.raises(CheckpointError) as caught:
        read_producer_config(_config(tmp_path, text))
    message = str(caught.value)
    assert f"quantization_config.descriptor is {expected:,} bytes" in message
    assert "at most 262,144 bytes (256 KiB" in message and "qscheme quantize" in message
    assert len(message) < 1000


def test_inspect_lists_the_refusal(tmp_path: Path) -> None:
    folder = _config(tmp_path, "#" * (MAX_EMBEDDED_DESCRIPTOR_BYTES + 1))
    save_file({"model.norm.weight": torch.ones(4)}, folder / "model.safetensors")
    inspection = inspect_checkpoint(folder)
    assert not inspection.ok and "an embedded scheme descriptor is at most" in inspection.problems[0]


def test_a_descriptor_with_thousands_of_problems_gives_a_bounded_error(tmp_path: Path) -> None:
    keys = "".join(f"  bad_key_{index}: 1\n" for index in range(10_000))
    text = f"name: test/X\nweight:\n{keys}"
    assert len(text.encode()) < MAX_EMBEDDED_DESCRIPTOR_BYTES
    with pytest.raises(CheckpointError) as caught:
        embedded_scheme(read_producer_config(_config(tmp_path, text, scheme="test/X")))
    message = str(caught.value)
    found = re.search(r"is not a valid scheme descriptor \((\d+) problem\(s\)\):\n", message)
    assert found is not None and int(found.group(1)) > 10_000
    listed = message[found.end() :].split("\n... and ")[0].splitlines()
    assert len(listed) == EMBEDDED_PROBLEMS_SHOWN
    assert f"... and {int(found.group(1)) - EMBEDDED_PROBLEMS_SHOWN} more problem(s) like these" in message
    assert "bad_key_0" in message and "bad_key_9999" not in message
    assert len(message) < 30_000
