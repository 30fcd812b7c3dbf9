"""A save's planning share on a thread rank: its own CPU from the start of the save
until it begins writing its data (describing its state, agreeing, planning by key
owners and placing its records; on a repeated save: describing, looking its plan up
and one agreement). The issue's planning targets are about this part; the rest of a
save (writing data, reporting checksums, an owner's share of the records, rank 0's
join) is reported beside it as the whole save's CPU.

`clocked()` wraps `saving.write_rank_file` for its duration; in a rank's thread,
`begin()` before the save and `planned()` after it give the seconds.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from shardwise.checkpoint.engine import saving

__all__ = ["begin", "clocked", "planned"]

_MARKS = threading.local()


@contextlib.contextmanager
def clocked() -> Iterator[None]:
    original = saving.write_rank_file

    def writing(*args: Any, **kwargs: Any) -> Any:
        _MARKS.writing = time.thread_time()
        return original(*args, **kwargs)

    saving.write_rank_file = writing  # type: ignore[assignment]
    try:
        yield
    finally:
        saving.write_rank_file = original  # type: ignore[assignment]


def begin() -> None:
    _MARKS.start, _MARKS.writing = time.thread_time(), None


def planned() -> float:
    """This thread's planning seconds since `begin` (all of it when it wrote nothing)."""
    end = _MARKS.writing if _MARKS.writing is not None else time.thread_time()
    return end - _MARKS.start
