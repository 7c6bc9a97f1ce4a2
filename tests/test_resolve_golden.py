"""Golden `qscheme resolve` traces: which kernel every built-in scheme gets on each device, and
why every other kernel was rejected (tests/snapshots/golden/resolve_<device>.txt).

One file per device (cpu, and simulated sm80, sm89, sm90, sm100, sm103, sm120, which assume a
CUDA build of the local torch release), each holding the CLI's own output for every built-in
scheme on a 4096x4096 layer with bf16 activations, built-in plugins only, no QSCHEME_ or
TRITON_ variables set. The device and note lines (versions) are left out. A change to a
declaration, a priority or the resolver shows here as a diff to review; regenerate with
``QSCHEME_UPDATE_SNAPSHOTS=1 pytest tests/test_resolve_golden.py``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from kernel_fakes import isolated_plugins

from qscheme.catalog import load_catalog
from qscheme.cli.main import main

GOLDEN = Path(__file__).parent / "snapshots" / "golden"
UPDATE = os.environ.get("QSCHEME_UPDATE_SNAPSHOTS") == "1"
DEVICES = ("cpu", "sm80", "sm89", "sm90", "sm100", "sm103", "sm120")
SCHEMES = tuple(sorted(s.name for s in load_catalog(include_plugins=False)))


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in list(os.environ):
        if name.startswith(("QSCHEME_", "TRITON_")):
            monkeypatch.delenv(name)
    with isolated_plugins():
        yield


def trace(scheme: str, device: str, capsys: pytest.CaptureFixture[str]) -> str:
    code = main(["resolve", scheme, "--device", device])
    captured = capsys.readouterr()
    kept = [line.rstrip() for line in captured.out.splitlines() if not line.startswith(("device:", "note:"))]
    text = "\n".join(kept).strip()
    if code != 0:
        text += f"\n(exit {code})\n" + captured.err.strip()
    return f"=== {scheme} on {device}\n{text}\n"


@pytest.mark.parametrize("device", DEVICES)
def test_golden_trace(device: str, capsys: pytest.CaptureFixture[str]) -> None:
    text = "\n".join(trace(scheme, device, capsys) for scheme in SCHEMES)
    path = GOLDEN / f"resolve_{device}.txt"
    if UPDATE or not path.exists():
        if not UPDATE and os.environ.get("CI"):
            pytest.fail(f"golden trace {path} is missing; generate it with QSCHEME_UPDATE_SNAPSHOTS=1")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{path} differs; review, then regenerate with QSCHEME_UPDATE_SNAPSHOTS=1"


def test_every_device_names_a_kernel_for_every_scheme() -> None:
    """The traces are complete: one section per built-in scheme on each device, each naming a kernel."""
    for device in DEVICES:
        text = (GOLDEN / f"resolve_{device}.txt").read_text()
        sections = [s for s in text.split("=== ") if s.strip()]
        assert [s.split(" on ", 1)[0] for s in sections] == list(SCHEMES)
        for section in sections:
            assert "\nkernel: " in section or "(exit 1)" in section, section


def chosen_kernels(device: str) -> dict[str, str]:
    """Scheme -> chosen kernel (or "none") as the golden trace of the device records it."""
    chosen = {}
    for section in (GOLDEN / f"resolve_{device}.txt").read_text().split("=== ")[1:]:
        scheme = section.split(" on ", 1)[0]
        first = section.splitlines()[1]
        chosen[scheme] = first.split()[1] if first.startswith("kernel: ") and "none" not in first.split()[1] else "none"
    return chosen


def test_the_kernels_doc_table_is_the_golden_traces() -> None:
    """docs/kernels.md's "what runs where" table says what the traces say, cell for cell."""
    text = (Path(__file__).parents[1] / "docs" / "kernels.md").read_text()
    table = text.split("<!-- choice-table")[1].split("\n\n")[0].splitlines()[1:]
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert header == ["scheme", *DEVICES]
    rows = {}
    for line in table[2:]:
        cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(DEVICES, cells[1:], strict=True))
    assert sorted(rows) == list(SCHEMES)
    for device in DEVICES:
        assert {scheme: rows[scheme][device] for scheme in SCHEMES} == chosen_kernels(device), device
