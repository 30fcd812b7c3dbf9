"""A save's planning share on a thread rank: its own CPU from the start of the save
until it begins building its share of the records or writing its data
(describing its state, agreeing, planning by key owners, placing its records and
reporting their places; on a repeated save: describing, looking its plan up and
one agreement). The issue's planning targets are about this part; the rest of a
save (an owner's share of the records, writing data) is reported beside it as the
whole save's CPU. Rank 0's join
of the records runs on a thread of its own beside its writes: its CPU is measured
there (`joined()`).

`clocked()` wraps `engine.save.owned_part`, `engine.save.write_rank_file` and
`engine.records.join_records` for its duration; in a rank's thread, `begin()` before the save
and `planned()` after it give the seconds.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from shardwise.checkpoint.engine import records as joining
from shardwise.checkpoint.engine import save as saving

__all__ = ["begin", "clocked", "joined", "planned"]

_MARKS = threading.local()


_JOINS: list[float] = []  # the CPU seconds of each join, in its own thread


@contextlib.contextmanager
def clocked() -> Iterator[None]:
    originals = saving.owned_part, saving.write_rank_file, joining.join_records

    def ending(original: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if getattr(_MARKS, "writing", None) is None:
                _MARKS.writing = time.thread_time()
            return original(*args, **kwargs)

        return wrapped

    def timed_join(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return originals[2](*args, **kwargs)
        finally:
            _JOINS.append(time.thread_time() - start)

    saving.owned_part = ending(originals[0])  # type: ignore[assignment]
    saving.write_rank_file = ending(originals[1])  # type: ignore[assignment]
    joining.join_records = timed_join  # type: ignore[assignment]
    try:
        yield
    finally:
        saving.owned_part, saving.write_rank_file, joining.join_records = originals  # type: ignore[assignment]


def joined() -> float:
    """The CPU seconds of every join of the records so far."""
    return sum(_JOINS)


def begin() -> None:
    _MARKS.start, _MARKS.writing = time.thread_time(), None


def planned() -> float:
    """This thread's planning seconds since `begin` (all of it when it wrote nothing)."""
    end = _MARKS.writing if _MARKS.writing is not None else time.thread_time()
    return end - _MARKS.start
