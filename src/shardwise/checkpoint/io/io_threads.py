"""The thread pools of a checkpoint's I/O, kept between saves and loads: writers (slabs
written at their offsets) and readers (large local reads). A local disk or tmpfs
moves bytes faster with several requests in flight; each pool is remade after a
fork (threads do not survive one)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

__all__ = ["reader_pool", "writer_pool"]

_THREAD_POOLS: dict[str, tuple[ThreadPoolExecutor, int]] = {}  # name -> (pool, pid it belongs to)


def _pool(name: str) -> ThreadPoolExecutor:
    kept = _THREAD_POOLS.get(name)
    if kept is None or kept[1] != os.getpid():
        pool = ThreadPoolExecutor(
            min(8, os.cpu_count() or 1), thread_name_prefix=f"shardwise-{name}"
        )
        _THREAD_POOLS[name] = kept = (pool, os.getpid())
    return kept[0]


def writer_pool() -> ThreadPoolExecutor:
    return _pool("write")


def reader_pool() -> ThreadPoolExecutor:
    return _pool("read")
