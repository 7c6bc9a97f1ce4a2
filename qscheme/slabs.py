"""Elementwise work over slabs of weight rows, spread over a few threads.

Quantizing or dequantizing a weight takes a dozen elementwise passes. Run on the whole weight,
each pass streams it through memory; run on slabs of rows that stay in cache, the passes cost
far less. The slabs are shared out over ``torch.get_num_threads()`` worker threads, each of
which runs torch single-threaded (with torch's OpenMP backend the thread count is per thread),
and torch releases the GIL while computing. Independent slabs need no barrier after every
operation, which keeps the work fast on a machine busy with other processes. Results do not
depend on the number of threads: every slab is computed the same way.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

SLAB_ELEMENTS = 1 << 18
BLOCK_SLAB_ELEMENTS = 1 << 21
"""Slabs of packed blocks decoded by one C pass each: 8 MB of float32 output (see ``formats.blocks``)."""

_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()
_caller = threading.local()  # .workers: set while a caller runs single-threaded (see below)


def row_slabs(rows: int, row_elements: int, unit: int = 1, target: int | None = None) -> list[slice]:
    """Row ranges covering ``rows`` rows, each a multiple of ``unit`` rows (but the last) holding
    about ``target`` elements (at least ``unit`` rows)."""
    step = max(1, (target or SLAB_ELEMENTS) // max(1, unit * row_elements)) * unit
    return [slice(start, min(rows, start + step)) for start in range(0, rows, step)]


def _single_threaded() -> None:
    torch.set_num_threads(1)  # this worker thread only (OpenMP keeps the count per thread)
    torch.zeros(1).add_(1)  # settle the thread's count now: later calls elsewhere cannot reset it


@functools.cache
def _per_thread_torch_threads() -> bool:
    """Whether torch's thread count is per thread (its OpenMP backend), so workers can own one each."""
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


def _workers(count: int) -> ThreadPoolExecutor:
    with _pools_lock:
        if count not in _pools:
            _pools[count] = ThreadPoolExecutor(count, thread_name_prefix="qscheme", initializer=_single_threaded)
        return _pools[count]


@contextlib.contextmanager
def single_threaded_caller() -> Iterator[None]:
    """Run torch single-threaded on the calling thread meanwhile, and spread ``run_slabs`` over as
    many workers as the caller had threads: the small operations between slabs then need no
    barrier either (only where torch's thread count is per thread; otherwise nothing changes)."""
    threads = torch.get_num_threads()
    if threads <= 1 or getattr(_caller, "workers", None) or not _per_thread_torch_threads():
        yield
        return
    _caller.workers = threads
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        _caller.workers = 0


def run_slabs(work: Callable[[slice], None], slabs: list[slice], device: torch.device) -> None:
    """Call ``work(slab)`` for every slab: inline on an accelerator, for a single slab or a single
    thread, else on the worker threads."""
    workers = getattr(_caller, "workers", None) or torch.get_num_threads()
    if device.type != "cpu" or len(slabs) <= 1 or workers <= 1 or not _per_thread_torch_threads():
        for slab in slabs:
            work(slab)
        return
    pool = _workers(workers)
    for future in [pool.submit(work, slab) for slab in slabs]:
        future.result()


def slabs_for(
    device: torch.device, rows: int, row_elements: int, unit: int = 1, target: int | None = None
) -> list[slice]:
    """Row slabs suited to ``device`` (of about ``target`` elements on a CPU): one slab of all rows
    on an accelerator."""
    if device.type != "cpu":
        return [slice(0, rows)]
    return row_slabs(rows, row_elements, unit, target)
