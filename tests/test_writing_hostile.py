"""A property of the writer over generated hostile source folders (issue 24, "Must show").

Each example builds a small unquantized checkpoint folder and adds, as drawn: links to files
inside and outside it, links to devices and to folders (loops), FIFOs, nested folders, a big
file over the copy bound, a tensor named like one the writer produces, a shard header claiming
a huge size, an existing DST (replaced with ``force``) or one the source links into, and an
ignore list (wildcards with several ``*``, ``re:`` patterns, one the backtracking guard refuses).

After every run, exactly one of:

- the run succeeded, and DST loads back through ``qscheme.load_checkpoint`` with exactly the
  expected quantized modules (computed here from the ignore list), the plain tensors equal to
  the source's, and every copied file equal to what its source entry resolves to;
- a typed QSchemeError was raised, there is no output (DST absent, or an existing DST unchanged),
  and no temporary folder is left.

Either way the source is unchanged (names, link targets, file bytes, hash-checked). Examples are
bounded (``max_examples``) so the test runs in well under a minute on two cores.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import qscheme
from qscheme.errors import QSchemeError
from qscheme.writing.other_files import SIZE_VARIABLE
from qscheme.writing.quantize import quantize_checkpoint

SCHEME = "compressed-tensors/W4A16"
BOUND = 4096  # the copy bound for this test (QSCHEME_MAX_COPIED_FILE_BYTES)
IGNORES = [
    None,
    [],
    ["lm_head"],
    ["lm_head", "*.q_proj"],
    ["lm_head", "*a*t*n*"],
    ["*.*.*.*.up_proj", "re:lm_.*"],
    ["re:.*mlp\\..*"],
    ["re:(a+)+x"],
]
EXTRAS = [
    "link_in",
    "link_out",
    "link_device",
    "link_folder_loop",
    "link_parent",
    "fifo",
    "nested",
    "big_file",
    "colliding_tensor",
    "huge_header",
    "dst_exists",
    "source_links_into_dst",
]


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.05).to(torch.bfloat16)

    return {
        "model.embed_tokens.weight": rand(64, 128),
        "model.layers.0.input_layernorm.weight": torch.ones(128, dtype=torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": rand(128, 128),
        "model.layers.0.self_attn.o_proj.weight": rand(128, 128),
        "model.layers.0.mlp.up_proj.weight": rand(128, 128),
        "model.layers.0.mlp.down_proj.weight": rand(128, 128),
        "model.norm.weight": torch.ones(128, dtype=torch.bfloat16),
        "lm_head.weight": rand(64, 128),
    }


TENSORS = _tensors()


def snapshot(folder: Path) -> str:
    """Everything under ``folder`` without following links: names, kinds, link targets, bytes."""
    sha = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        sha.update(str(path.relative_to(folder)).encode())
        if path.is_symlink():
            sha.update(b"link " + os.readlink(path).encode())
        elif path.is_fifo():
            sha.update(b"fifo")
        elif path.is_file():
            sha.update(path.read_bytes())
        else:
            sha.update(b"dir")
    return sha.hexdigest()


def expected_quantized(ignore: list[str] | None) -> set[str]:
    entries = ["lm_head"] if ignore is None else ignore
    out = set()
    for name, value in TENSORS.items():
        module = name.removesuffix(".weight")
        if value.dim() != 2 or module.endswith("norm") or "embed" in module:
            continue
        ignored = any(
            re.match(entry[3:], module) if entry.startswith("re:") else fnmatch.fnmatchcase(module, entry)
            for entry in entries
        )
        if not ignored:
            out.add(module)
    return out


def build(root: Path, extras: set[str]) -> tuple[Path, Path]:
    src, outside, dst = root / "src", root / "outside", root / "dst"
    src.mkdir()
    outside.mkdir()
    (outside / "secret.txt").write_text("outside")
    tensors = dict(TENSORS)
    if "colliding_tensor" in extras:
        tensors["model.layers.0.mlp.up_proj.weight_scale"] = torch.ones(128, 1, dtype=torch.bfloat16)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    (src / "config.json").write_text('{"model_type": "llama"}')
    (src / "tokenizer.json").write_text('{"model": "bpe"}')
    if "huge_header" in extras:
        with open(src / "model.safetensors", "r+b") as handle:
            handle.write(struct.pack("<Q", 1 << 40))
    if "link_in" in extras:
        (src / "vocab.json").symlink_to("tokenizer.json")
    if "link_out" in extras:
        (src / "secret.txt").symlink_to(outside / "secret.txt")
    if "link_device" in extras:
        (src / "zeros").symlink_to("/dev/zero")
    if "link_folder_loop" in extras:
        (src / "loop").symlink_to(".")
    if "link_parent" in extras:
        (src / "parent").symlink_to("..")
    if "fifo" in extras:
        os.mkfifo(src / "pipe")
    if "nested" in extras:
        (src / "extra" / "deeper").mkdir(parents=True)
        (src / "extra" / "deeper" / "notes.txt").write_text("notes")
    if "big_file" in extras:
        (src / "big.bin").write_bytes(b"x" * (BOUND + 1))
    if "dst_exists" in extras or "source_links_into_dst" in extras:
        dst.mkdir()
        (dst / "old.txt").write_text("old output")
    if "source_links_into_dst" in extras:
        (src / "old_link.txt").symlink_to(dst / "old.txt")
    return src, dst


def check_output(src: Path, dst: Path, ignore: list[str] | None) -> None:
    checkpoint = qscheme.load_checkpoint(dst)
    assert set(checkpoint.modules) == expected_quantized(ignore)
    written = load_file(str(dst / "model.safetensors"))
    for name, value in TENSORS.items():
        if name.removesuffix(".weight") not in checkpoint.modules:
            assert torch.equal(written[name], value), name
    for entry in src.rglob("*"):
        if entry.name.endswith(".safetensors") or entry.name == "config.json" or entry.is_dir():
            continue
        copied = dst / entry.relative_to(src)
        assert copied.is_file() and not copied.is_symlink(), copied
        assert copied.read_bytes() == Path(os.path.realpath(entry)).read_bytes(), copied


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(extras=st.sets(st.sampled_from(EXTRAS), max_size=3), ignore=st.sampled_from(IGNORES), force=st.booleans())
def test_the_writer_loads_back_or_refuses_leaving_nothing(
    extras: set[str], ignore: list[str] | None, force: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SIZE_VARIABLE, str(BOUND))
    root = Path(tempfile.mkdtemp(prefix="qscheme-hostile-"))
    try:
        src, dst = build(root, extras)
        source_before = snapshot(src)
        dst_before = snapshot(dst) if dst.exists() else None
        try:
            quantize_checkpoint(src, dst, SCHEME, ignore=ignore, force=force, progress=False)
        except QSchemeError:
            if dst_before is None:
                assert not os.path.lexists(dst)
            else:
                assert snapshot(dst) == dst_before
            succeeded = False
        else:
            check_output(src, dst, ignore)
            succeeded = True
        assert snapshot(src) == source_before
        assert sorted(entry.name for entry in root.iterdir() if entry.name.startswith(".")) == []  # no temp folder
        refused = {"link_out", "link_device", "link_folder_loop", "link_parent", "fifo", "big_file"}
        refused |= {"colliding_tensor", "huge_header", "source_links_into_dst"}
        must_fail = bool(extras & refused) or (dst_before is not None and not force) or ignore == ["re:(a+)+x"]
        assert succeeded != must_fail, (extras, ignore, force)
    finally:
        shutil.rmtree(root, ignore_errors=True)
