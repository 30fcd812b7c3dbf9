"""Device copies and the bounded resources every copy goes through.

Copies between device memory and host slabs run on side streams, marked by
events; a load's bytes for device targets land in pinned stand-ins first. Both
draw on one bounded pool of host memory per purpose (`staging_bytes`) and on
the thread pools kept between saves and loads, so no save or load holds more
host memory than its budget, whatever its state's size.
"""

from __future__ import annotations

import os
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager

import torch

from ...errors import InvalidArgumentError

__all__ = [
    "Copier",
    "DEFAULT_STAGING_BYTES",
    "DeviceCopier",
    "DeviceLanding",
    "HostCopier",
    "HostSlabs",
    "Mark",
    "PACK_BYTES",
    "device_bytes",
    "reader_pool",
    "slab_size",
    "slabs_for",
    "staging_bytes",
    "writer_pool",
]


# -----------------------------------------------------------------------------
# Copies between device memory and host slabs, on side streams, marked by events.
#
# A save's device→host copies and a load's host→device copies run on one side
# stream per device, so they overlap the caller's compute and the file I/O of
# other slabs. The side stream first waits for the caller's work (`after`: an
# event recorded on the caller's stream when the save was called, or the
# caller's current stream): a copy never reads a tensor before the kernels that
# produce it have run. Each batch of copies ends with a `Mark` (an event per
# device used) that the host waits on before it touches the slab.
#
# Small device tensors are packed on the device first (one `torch.cat` into a
# bounded device buffer, then one copy), so 10,000 of them cost a few hundred
# kernel launches, not 10,000 copies.
#
# `HostCopier` is the same interface over CPU tensors, copying at once: the
# pipelines that use these (`io.write`, `io.read`) are tested on
# machines without a GPU through it.
# -----------------------------------------------------------------------------

PACK_BYTES = 32 << 20  # the device buffer small tensors are packed into, per device


def device_bytes(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values in C order as a flat uint8 tensor where `t` lives: a view when its
    memory already is that, else a copy made there (a pending conjugation or
    negation applied, as the record stores values)."""
    t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


class Mark:
    """The end of a batch of copies: `wait` returns once they are done."""

    __slots__ = ("_events",)

    def __init__(self, events: Sequence[torch.cuda.Event] = ()) -> None:
        self._events = list(events)

    def wait(self) -> None:
        for e in self._events:
            e.synchronize()

    def done(self) -> bool:
        return all(e.query() for e in self._events)


class Copier(ABC):
    """Copies into and out of host slabs; `mark()` closes a batch."""

    @abstractmethod
    def bytes_of(self, t: torch.Tensor) -> torch.Tensor:
        """`device_bytes(t)`, any copy it needs made in the copies' order (after what
        they wait for)."""

    @abstractmethod
    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """`dst` (host bytes) takes `src`'s bytes (a flat uint8 view of the same size)."""

    @abstractmethod
    def pack_to_host(self, dst: torch.Tensor, srcs: Sequence[torch.Tensor]) -> None:
        """`dst` takes the flat uint8 views `srcs`, back to back."""

    @abstractmethod
    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """`dst` (device bytes) takes host bytes `src`."""

    @abstractmethod
    def mark(self) -> Mark:
        """Close the batch of copies issued since the last mark."""

    def mark_all(self) -> Mark:
        """A mark after every copy issued so far, on every device."""
        return self.mark()

    @abstractmethod
    def join(self) -> None:
        """Order the caller's later work after every copy made so far."""

    @abstractmethod
    def close(self) -> None:
        """Free what the copies kept between batches."""


class HostCopier(Copier):
    """Copies made at once, marks already done: the pipelines' CPU form."""

    def bytes_of(self, t: torch.Tensor) -> torch.Tensor:
        return device_bytes(t)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def pack_to_host(self, dst: torch.Tensor, srcs: Sequence[torch.Tensor]) -> None:
        torch.cat(list(srcs), out=dst)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def mark(self) -> Mark:
        return Mark()

    def join(self) -> None:
        return None

    def close(self) -> None:
        return None


class DeviceCopier(Copier):
    """Non-blocking copies on a side stream per CUDA device.

    `after`: per device index, an event on the caller's stream the copies must
    follow (an asynchronous save records it when called); a device without one
    follows the caller's current stream as it is now."""

    def __init__(self, after: dict[int, torch.cuda.Event] | None = None) -> None:
        self._after = dict(after or {})
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._used: set[int] = set()
        self._pack: dict[int, torch.Tensor] = {}

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._used.add(index)
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = torch.cuda.Stream(device=index)
            event = self._after.get(index)
            if event is not None:
                stream.wait_event(event)
            else:
                stream.wait_stream(torch.cuda.current_stream(index))
        return stream

    def bytes_of(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_contiguous() and not (t.is_conj() or t.is_neg()):  # a view: no kernel
            return t.detach().reshape(-1).view(torch.uint8)
        with torch.cuda.stream(self._stream(t.device)):  # its copy follows `after`
            return device_bytes(t)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self._stream(src.device)):
            dst.copy_(src, non_blocking=True)

    def pack_to_host(self, dst: torch.Tensor, srcs: Sequence[torch.Tensor]) -> None:
        device = srcs[0].device
        stream = self._stream(device)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            index = stream.device_index
            pack = self._pack.get(index)
            if pack is None:  # allocated on the side stream: reused in its order only
                pack = self._pack[index] = torch.empty(PACK_BYTES, dtype=torch.uint8, device=device)
            n = dst.numel()
            torch.cat(list(srcs), out=pack[:n])
            dst.copy_(pack[:n], non_blocking=True)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self._stream(dst.device)):
            dst.copy_(src, non_blocking=True)

    def mark(self) -> Mark:
        events = []
        for index in sorted(self._used):
            event = torch.cuda.Event()
            event.record(self._streams[index])
            events.append(event)
        self._used.clear()
        return Mark(events)

    def mark_all(self) -> Mark:
        self._used.update(self._streams)
        return self.mark()

    def join(self) -> None:
        """Make this thread's current streams wait for every copy: a load's targets are
        then ready for the caller's next kernel."""
        for index, stream in self._streams.items():
            torch.cuda.current_stream(index).wait_stream(stream)

    def close(self) -> None:
        """Drop the packing buffers (call once every mark was waited on)."""
        self._pack.clear()


# -----------------------------------------------------------------------------
# The bounded host memory every device copy of a save or a load goes through.
#
# A rank's staging budget (`staging_bytes`: the argument, else the environment's
# `SHARDWISE_STAGING_BYTES`, else `DEFAULT_STAGING_BYTES`) is cut into equal slabs,
# pinned when CUDA is available so that copies run on the copy engines without a
# bounce through pageable memory. A state larger than the budget moves in waves:
# a slab is reused once its bytes are written (a save) or copied to the device (a
# load). Slabs are allocated on first use and kept for the next save or load of the
# same budget: a training loop's later checkpoints allocate nothing. Slab sizes
# are powers of two, which PyTorch's pinned-memory cache rounds to anyway.
#
# Saves and loads have a pool each, so a load never waits on an asynchronous
# save's buffers; one pipeline uses a pool at a time (`HostSlabs.lease`).
# -----------------------------------------------------------------------------

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


# -----------------------------------------------------------------------------
# Where a load's bytes for device targets land: pinned stand-ins, then the device.
#
# A read into a CUDA target reads into a stand-in — a host tensor of the chunk's
# shape carved from a pinned slab (`io.device`, the load's own pool) — and the
# stand-in is then copied to the target on a side stream (`io.device`), so
# the next read runs while the copy engine moves the last one. Never through
# pageable or mmap'd memory, and within the staging budget: slabs are carved in
# order, and one is carved again only once every stand-in in it was handed to the
# device and those copies are done.
#
# `finish` waits for every copy and orders the caller's streams after them: when
# the load returns, the targets hold the data.
# -----------------------------------------------------------------------------

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


# -----------------------------------------------------------------------------
# The thread pools of a checkpoint's I/O, kept between saves and loads: writers (slabs
# written at their offsets) and readers (large local reads). A local disk or tmpfs
# moves bytes faster with several requests in flight; each pool is remade after a
# fork (threads do not survive one).
# -----------------------------------------------------------------------------

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
