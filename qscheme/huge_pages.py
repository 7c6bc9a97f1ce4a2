"""Large new buffers backed by huge pages where the OS offers them on request.

A new tensor of tens of MB is paid for in page faults when first written: 16,000 of them for
64 MB of 4 KiB pages (about 29 ms on the 2-core machine, whatever writes it). Linux's transparent
huge pages in ``madvise`` mode back a region with 2 MiB pages once it is advised, and the same
64 MB then costs a few dozen faults (about 11 ms). ``empty`` makes the tensor and advises its
2 MiB-aligned interior before anything touches it; the advice is taken by the C extension
(``qscheme._blocks.advise_huge``), and nothing changes where it is not built, off Linux, or
where huge pages are off. Same values, same tensor type: only the kernel's paging differs.
Checkpoint readers use it for the bytes they read, decoders for the weights they write.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

HUGE_BYTES = 4 << 20
"""New buffers from this size on are advised onto huge pages."""


@functools.cache
def _advise() -> Any:
    try:
        from qscheme._blocks import advise_huge  # type: ignore[import-not-found]  # a C extension (setup.py)
    except ImportError:
        return None
    return advise_huge


def empty(shape: int | tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on the CPU, advised onto huge pages when it is large."""
    out = torch.empty(shape, dtype=dtype)
    nbytes = out.numel() * out.element_size()
    advise = _advise() if nbytes >= HUGE_BYTES else None
    if advise is not None:
        advise(out.data_ptr(), nbytes)
    return out
