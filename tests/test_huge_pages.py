"""qscheme.huge_pages: large new buffers advised onto huge pages, small ones left alone."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from qscheme.huge_pages import HUGE_BYTES, empty

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_kb_at(address: int) -> int:
    """AnonHugePages (kB) of the mapping holding ``address`` (/proc/self/smaps)."""
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            mapping = int(span.group(1), 16) <= address < int(span.group(2), 16)
        elif mapping and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_values_shape_and_dtype_are_torch_empty_s() -> None:
    for shape, dtype in [((3, 5), torch.float32), (HUGE_BYTES, torch.uint8), ((1024, 2048), torch.bfloat16)]:
        out = empty(shape, dtype)
        assert out.dtype == dtype and out.is_contiguous() and not out.requires_grad
        assert tuple(out.shape) == (shape if isinstance(shape, tuple) else (shape,))
        out.fill_(7)
        assert bool((out == 7).all())


def test_a_large_buffer_is_backed_by_huge_pages_where_the_os_offers_them() -> None:
    pytest.importorskip("qscheme._blocks", reason="the C extension was not built (no C compiler at install)")
    mode = THP.read_text() if THP.exists() else ""
    if "[madvise]" not in mode and "[always]" not in mode:
        pytest.skip(f"transparent huge pages are off here ({mode.strip() or 'no ' + str(THP)})")
    out = empty((4096, 4096))
    out.fill_(1.0)
    assert _huge_kb_at(out.data_ptr() + out.numel() * 2) >= 2048
