"""The bounded host memory every device copy of a save or a load goes through.

A rank's staging budget (`staging_bytes`: the argument, else the environment's
`SHARDWISE_STAGING_BYTES`, else `DEFAULT_STAGING_BYTES`) is cut into equal slabs,
pinned when CUDA is available so that copies run on the copy engines without a
bounce through pageable memory. A state larger than the budget moves in waves:
a slab is reused once its bytes are written (a save) or copied to the device (a
load). Slabs are allocated on first use and kept for the next save or load of the
same budget: a training loop's later checkpoints allocate nothing. Slab sizes
are powers of two, which PyTorch's pinned-memory cache rounds to anyway.

Saves and loads have a pool each, so a load never waits on an asynchronous
save's buffers; one pipeline uses a pool at a time (`HostSlabs.lease`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ...errors import InvalidArgumentError

__all__ = ["DEFAULT_STAGING_BYTES", "HostSlabs", "slab_size", "slabs_for", "staging_bytes"]

DEFAULT_STAGING_BYTES = 1 << 30
_MIN_SLAB = 1 << 20
_MAX_SLAB = 64 << 20  # larger slabs only delay the first write; 16 of them keep writers busy
_ENV = "SHARDWISE_STAGING_BYTES"


def staging_bytes(given: int | None = None) -> int:
    """The staging budget in bytes: `given`, else `SHARDWISE_STAGING_BYTES`, else 1 GiB."""
    if given is None:
        text = os.environ.get(_ENV)
        if not text:
            return DEFAULT_STAGING_BYTES
        try:
            given = int(text)
        except ValueError:
            raise InvalidArgumentError(f"{_ENV}={text!r} is not a number of bytes") from None
    if isinstance(given, bool) or not isinstance(given, int) or given < _MIN_SLAB:
        raise InvalidArgumentError(
            f"staging_bytes must be an int of at least {_MIN_SLAB} (1 MiB), got {given!r}"
        )
    memory = host_memory()
    if memory is not None and given > memory:
        raise InvalidArgumentError(
            f"staging_bytes={given} is more than this host's memory ({memory} bytes): the "
            f"staging buffers could never be allocated; give at most {memory} (the default "
            f"is {DEFAULT_STAGING_BYTES})"
        )
    return given


def host_memory() -> int | None:
    """This host's physical memory in bytes (None where the OS does not say): no
    staging budget can be larger, pinned or not."""
    try:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None
    return pages * page if pages > 0 and page > 0 else None


def slab_size(budget: int) -> int:
    """The largest power of two that cuts `budget` into at least 4 slabs, within bounds."""
    quarter = max(_MIN_SLAB, budget // 4)
    return max(_MIN_SLAB, min(_MAX_SLAB, 1 << (quarter.bit_length() - 1)))


class HostSlabs:
    """`count` host buffers of `size` bytes (pinned when `pin`), handed out and given back."""

    def __init__(self, budget: int, pin: bool) -> None:
        self.size = slab_size(budget)
        self.count = max(1, budget // self.size)
        self.pin = pin
        self._buffers: list[torch.Tensor | None] = [None] * self.count
        self._free = list(range(self.count - 1, -1, -1))  # taken from the end: slab 0 first
        self._lock = threading.Lock()

    @property
    def allocated(self) -> int:
        """Bytes of host memory the slabs hold now."""
        return sum(b.nbytes for b in self._buffers if b is not None)

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self) -> int | None:
        """A free slab's index (its buffer allocated on first use), or None when all are out."""
        if not self._free:
            return None
        index = self._free.pop()
        if self._buffers[index] is None:
            self._buffers[index] = torch.empty(self.size, dtype=torch.uint8, pin_memory=self.pin)
        return index

    def buffer(self, index: int) -> torch.Tensor:
        buf = self._buffers[index]
        assert buf is not None, "a slab is allocated when taken"
        return buf

    def give(self, index: int) -> None:
        """Give back a slab taken earlier: its bytes are no longer needed."""
        if index in self._free or not 0 <= index < self.count:
            raise InvalidArgumentError(f"slab {index} was not taken")
        self._free.append(index)

    @contextmanager
    def lease(self) -> Iterator[HostSlabs]:
        """Hold the pool for one pipeline; every slab is back when it ends, even on an error."""
        with self._lock:
            try:
                yield self
            finally:
                self._free = list(range(self.count - 1, -1, -1))


_POOLS: dict[str, HostSlabs] = {}
_POOLS_LOCK = threading.Lock()


def slabs_for(purpose: str, budget: int) -> HostSlabs:
    """The kept pool for `purpose` ("save" or "load") of `budget` bytes; a new budget
    replaces it (the old slabs are freed once no pipeline uses them)."""
    pin = torch.cuda.is_available()
    with _POOLS_LOCK:
        pool = _POOLS.get(purpose)
        if pool is None or pool.pin != pin or pool.size * pool.count != _rounded(budget):
            pool = _POOLS[purpose] = HostSlabs(budget, pin)
        return pool


def _rounded(budget: int) -> int:
    size = slab_size(budget)
    return size * max(1, budget // size)
