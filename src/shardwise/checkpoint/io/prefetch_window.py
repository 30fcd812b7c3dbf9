"""How a load's read jobs run: windows on an object store, reader threads locally.

Each read job names the byte ranges it needs. On a folder that `wants_prefetch`
(an object store) the jobs run in windows of `WINDOW` bytes: each window's ranges
are fetched at once, concurrently (`Folder.prefetch`), its reads run from what
was fetched, and it is released before the next. Locally, jobs of at least
`PARALLEL_BYTES` run on reader threads (a local disk or tmpfs reads faster with
several reads in flight), smaller ones on the caller's thread; the first
`ordered` jobs (objects, checked before any target is written) run first, alone.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_for

from ...storage import Folder
from .io_threads import reader_pool

__all__ = ["PARALLEL_BYTES", "WINDOW", "Job", "run_windowed"]

WINDOW = 64 << 20  # bytes fetched ahead at once from an object store (8 parts in flight)
PARALLEL_BYTES = 4 << 20  # local jobs from this size on go to reader threads

Job = tuple[dict[str, list[tuple[int, int]]], Callable[[], None]]  # (ranges by file, the read)


def run_windowed(folder: Folder, jobs: list[Job], ordered: int = 0, threads: int = 8) -> None:
    """Run `jobs`: on an object store in order, each window's ranges fetched at once
    first; locally the first `ordered` in order, then the rest on up to `threads`
    reader threads (the large ones). The first failure, in job order, is raised once
    every job started has ended."""
    if not folder.wants_prefetch:
        _run_local(jobs, ordered, threads)
        return
    start = 0
    while start < len(jobs):
        end, size = start, 0
        window: dict[str, list[tuple[int, int]]] = defaultdict(list)
        while end < len(jobs) and (end == start or size < WINDOW):
            for name, ranges in jobs[end][0].items():
                window[name] += ranges
                size += sum(e - s for s, e in ranges)
            end += 1
        folder.prefetch(window)
        try:
            for _ranges, read in jobs[start:end]:
                read()
        finally:
            folder.release()
        start = end


def _run_local(jobs: list[Job], ordered: int, threads: int) -> None:
    for _ranges, read in jobs[:ordered]:
        read()
    pool = reader_pool() if threads > 1 else None
    started: list[Future] = []
    try:
        for ranges, read in jobs[ordered:]:
            if pool is None or _size(ranges) < PARALLEL_BYTES:
                read()
                continue
            running = [f for f in started if not f.done()]
            if len(running) >= threads:  # at most `threads` in flight
                wait_for(running, return_when="FIRST_COMPLETED")
            started.append(pool.submit(read))
    finally:
        wait_for(started)
    for future in started:
        future.result()


def _size(ranges: dict[str, list[tuple[int, int]]]) -> int:
    return sum(e - s for spans in ranges.values() for s, e in spans)
