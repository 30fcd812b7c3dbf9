"""Where a load's bytes for device targets land: pinned stand-ins, then the device.

A read into a CUDA target reads into a stand-in — a host tensor of the chunk's
shape carved from a pinned slab (`host_slabs`, the load's own pool) — and the
stand-in is then copied to the target on a side stream (`device_copies`), so
the next read runs while the copy engine moves the last one. Never through
pageable or mmap'd memory, and within the staging budget: slabs are carved in
order, and one is carved again only once every stand-in in it was handed to the
device and those copies are done.

`finish` waits for every copy and orders the caller's streams after them: when
the load returns, the targets hold the data.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import ExitStack

import torch

from .device_copies import Copier, DeviceCopier, Mark
from .host_slabs import HostSlabs, slab_size, slabs_for

__all__ = ["DeviceLanding"]

_ALIGN = 64
_WAIT_S = 0.05  # how long a read waits for a slab others hold before it uses scratch


class _Slab:
    __slots__ = ("index", "used", "out", "closed", "mark")

    def __init__(self, index: int) -> None:
        self.index, self.used, self.out = index, 0, 0  # bytes carved; stand-ins not yet sent
        self.closed = False
        self.mark: Mark | None = None


class DeviceLanding:
    """Stand-ins for device targets, from a pool of `budget` bytes, taken on first use."""

    def __init__(self, budget: int, copier: Callable[[], Copier] = DeviceCopier) -> None:
        self.budget = budget
        self._make_copier = copier
        self._pool: HostSlabs | None = None
        self._lease = ExitStack()
        self._copier: Copier | None = None
        self._current: _Slab | None = None
        self._of: dict[int, _Slab] = {}  # stand-in data_ptr -> its slab
        self._retiring: deque[_Slab] = deque()  # closed, every stand-in sent, in order
        self._lock = threading.Condition(threading.RLock())  # reads run on several threads

    @property
    def slab_bytes(self) -> int:
        """The largest stand-in there can be (a larger chunk is read in pieces)."""
        return slab_size(self.budget)

    def owns(self, t: torch.Tensor) -> bool:
        """Whether `t` is a stand-in not yet sent."""
        with self._lock:
            return (t.data_ptr() if t.numel() else id(t)) in self._of

    def _slabs(self) -> HostSlabs:
        if self._pool is None:
            pool = slabs_for("load", self.budget)
            self._lease.enter_context(pool.lease())
            self._pool, self._copier = pool, self._make_copier()
        return self._pool

    def stand_in(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A pinned host tensor of `shape` and `dtype` to read into, or None when it
        does not fit a slab, or every slab is taken by reads still running (the caller
        reads in pieces, or through scratch)."""
        n = dtype.itemsize
        for s in shape:
            n *= s
        if n > slab_size(self.budget):
            return None
        with self._lock:
            deadline = time.monotonic() + _WAIT_S
            while (host := self._stand_in(shape, dtype)) is None:
                left = deadline - time.monotonic()
                if left <= 0:  # other reads hold every slab: the caller uses scratch
                    return None
                self._lock.wait(left)  # until a slab is sent and retired
            return host

    def _stand_in(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        pool = self._slabs()
        n = dtype.itemsize
        for s in shape:
            n *= s
        if n > pool.size:
            return None
        slab = self._current
        if slab is None or slab.used + n > pool.size:
            if slab is not None:
                self._close(slab)
            slab = self._current = self._next_slab()
            if slab is None:
                return None
        at = slab.used
        slab.used = -(-(at + n) // _ALIGN) * _ALIGN
        slab.out += 1
        host = pool.buffer(slab.index)[at : at + n].view(dtype).view(shape)
        self._of[host.data_ptr() if n else id(host)] = slab
        return host

    def follow_caller(self) -> None:
        """Order the copies after the work on the calling thread's current streams (call
        it there): reads on other threads then never overtake the caller's kernels."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            index = torch.cuda.current_device()  # the others: never touched unless used
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(index))
            self._make_copier = lambda: DeviceCopier({index: event})

    def copy(self, target: torch.Tensor, host: torch.Tensor) -> None:
        """Copy any host tensor into device `target` in the copies' order (scratch that
        is no stand-in: pageable memory, copied before this returns)."""
        with self._lock:
            self._slabs()
            assert self._copier is not None
            self._copier.to_device(target, host)

    def send(self, target: torch.Tensor, host: torch.Tensor) -> None:
        """Copy stand-in `host` into device `target` (same shape) on the side stream."""
        with self._lock:
            assert self._copier is not None
            if host.numel():
                self._copier.to_device(target, host)
            self.drop(host)

    def drop(self, host: torch.Tensor) -> None:
        """Stand-in `host` is done with (sent, or never used)."""
        with self._lock:
            slab = self._of.pop(host.data_ptr() if host.numel() else id(host))
            slab.out -= 1
            if slab.closed and slab.out == 0:
                self._retire(slab)

    def finish(self) -> None:
        """Wait for every copy, order the caller's streams after them, give the slabs back."""
        with self._lock:
            if self._pool is None:
                return
            try:
                if self._current is not None:
                    self._close(self._current)
                assert self._copier is not None
                for slab in self._retiring:
                    if slab.mark is not None:
                        slab.mark.wait()
                self._copier.mark().wait()  # stand-ins never sent (a failed read) included
                self._copier.join()
                self._copier.close()
            finally:
                self._pool, self._current, self._retiring, self._of = None, None, deque(), {}
                self._lease.close()

    def _close(self, slab: _Slab) -> None:
        slab.closed = True
        if slab.out == 0:
            self._retire(slab)

    def _retire(self, slab: _Slab) -> None:
        assert self._copier is not None
        slab.mark = self._copier.mark()  # after every copy out of it
        self._retiring.append(slab)
        self._lock.notify_all()

    def _next_slab(self) -> _Slab | None:
        pool = self._slabs()
        index = pool.take()
        if index is None and self._retiring:
            oldest = self._retiring.popleft()
            if oldest.mark is not None:
                oldest.mark.wait()
            pool.give(oldest.index)
            index = pool.take()
        return None if index is None else _Slab(index)
