"""The one prefetch window: how every read of a load reaches an object store.

Each read job names the byte ranges it needs. On a folder that `wants_prefetch`
(an object store) the jobs run in windows of `WINDOW` bytes: each window's ranges
are fetched at once, concurrently (`Folder.prefetch`), its reads run from what
was fetched, and it is released before the next; locally the reads just run.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from ...storage import Folder

__all__ = ["WINDOW", "Job", "run_windowed"]

WINDOW = 64 << 20  # bytes fetched ahead at once from an object store (8 parts in flight)

Job = tuple[dict[str, list[tuple[int, int]]], Callable[[], None]]  # (ranges by file, the read)


def run_windowed(folder: Folder, jobs: list[Job]) -> None:
    """Run `jobs` in order; on an object store, fetch each window's ranges at once first."""
    if not folder.wants_prefetch:
        for _ranges, read in jobs:
            read()
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
