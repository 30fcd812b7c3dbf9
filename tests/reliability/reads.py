"""Which bytes of which files a rank really read: shardwise's `Reader` reads data
files only with `os.pread` / `os.preadv`, so recording those calls (in the rank's
own process) shows whether a rank touched a given chunk."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["data_reads", "touches"]

Read = tuple[str, int, int]  # file name, first byte, end byte


@contextmanager
def data_reads() -> Iterator[list[Read]]:
    """Record every `(file name, start, end)` read with `os.pread` / `os.preadv` in this
    process while the block runs (Linux: the name comes from /proc/self/fd)."""
    reads: list[Read] = []
    pread, preadv = os.pread, os.preadv

    def name(fd: int) -> str:
        return os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))

    def recording_pread(fd: int, n: int, offset: int) -> bytes:
        data = pread(fd, n, offset)
        reads.append((name(fd), offset, offset + len(data)))
        return data

    def recording_preadv(fd: int, buffers: Any, offset: int, *flags: int) -> int:
        got = preadv(fd, buffers, offset, *flags)
        reads.append((name(fd), offset, offset + got))
        return got

    os.pread, os.preadv = recording_pread, recording_preadv
    try:
        yield reads
    finally:
        os.pread, os.preadv = pread, preadv


def touches(reads: list[Read], file: str, start: int, length: int) -> bool:
    """Whether any read overlaps bytes `start .. start + length` of `file`."""
    return any(f == file and lo < start + length and start < hi for f, lo, hi in reads)
