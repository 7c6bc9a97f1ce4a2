"""qscheme.huge_pages: large new buffers advised onto huge pages, small ones left alone."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from qscheme.huge_pages import HUGE_BYTES, empty

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping_facts(address: int) -> tuple[int, set[str]]:
    """AnonHugePages (kB) and VmFlags of the mapping holding ``address`` (/proc/self/smaps)."""
    mapping = None
    huge_kb, flags = 0, set()
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            mapping = int(span.group(1), 16) <= address < int(span.group(2), 16)
        elif mapping and line.startswith("AnonHugePages:"):
            huge_kb = int(line.split()[1])
        elif mapping and line.startswith("VmFlags:"):
            flags = set(line.split()[1:])
    return huge_kb, flags


def test_values_shape_and_dtype_are_torch_empty_s() -> None:
    for shape, dtype in [((3, 5), torch.float32), (HUGE_BYTES, torch.uint8), ((1024, 2048), torch.bfloat16)]:
        out = empty(shape, dtype)
        assert out.dtype == dtype and out.is_contiguous() and not out.requires_grad
        assert tuple(out.shape) == (shape if isinstance(shape, tuple) else (shape,))
        out.fill_(7)
        assert bool((out == 7).all())


def test_a_large_buffer_is_advised_onto_huge_pages_where_the_os_offers_them() -> None:
    """The buffer's mapping carries the huge-page advice (VmFlags ``hg``). Whether the kernel then
    backs it with 2 MiB pages is its own best effort (it may find no free huge page while other
    processes hold the memory), so the backing is not asserted."""
    pytest.importorskip("qscheme._blocks", reason="the C extension was not built (no C compiler at install)")
    mode = THP.read_text() if THP.exists() else ""
    if "[madvise]" not in mode and "[always]" not in mode:
        pytest.skip(f"transparent huge pages are off here ({mode.strip() or 'no ' + str(THP)})")
    out = empty((4096, 4096))
    out.fill_(1.0)
    _, flags = _mapping_facts(out.data_ptr() + out.numel() * 2)
    assert "hg" in flags, flags
    plain = torch.empty((4096, 4096))  # torch's own buffer of the same size: its own mapping, not advised
    plain.fill_(1.0)
    _, plain_flags = _mapping_facts(plain.data_ptr() + plain.numel() * 2)
    assert "hg" not in plain_flags, plain_flags
