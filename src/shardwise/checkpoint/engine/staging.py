"""Staging for `async_save`: a state dict's values snapshot into buffers kept
between saves.

A set of buffers belongs to one save until its writer hands it back, so two
saves in flight never share bytes; the copies are made in bulk (batched small
copies, large CPU tensors cut across threads, device tensors on a side stream
into pinned memory).
"""

from __future__ import annotations

import copy
import ctypes
import os
import queue
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

from ...errors import InvalidArgumentError
from ...interop import from_torch_sharded_tensor
from ...tensor import ShardedTensor, learned
from .inventory import LocalPieces

__all__ = ["Copies", "CopyPool", "Staged", "Stager", "bytes_of", "bytewise"]


# -----------------------------------------------------------------------------
# The copies of one snapshot, made in bulk: batched small copies, large CPU tensors cut
# into byte ranges for a kept thread pool (see `staging`).
#
# Split from `staging` so that the walk over a state (what to copy where) and the
# machinery that moves the bytes (how) read separately.
# -----------------------------------------------------------------------------

# A byte range of one copy: destination and source (flat uint8 views), offset, byte count.
_Range = tuple[torch.Tensor, torch.Tensor, int, int]


def _copy_range(dst: torch.Tensor, src: torch.Tensor, start: int, n: int, memcpy: bool) -> None:
    if memcpy:
        ctypes.memmove(dst.data_ptr() + start, src.data_ptr() + start, n)
    else:
        dst[start : start + n].copy_(src[start : start + n])


def _pieces(copies: list[tuple[torch.Tensor, torch.Tensor]], piece: int) -> list[list[_Range]]:
    """Cut the concatenation of the (destination, source) byte views in `engine.staging`
    into consecutive pieces of `piece` bytes (the last one shorter)."""
    pieces: list[list[_Range]] = []
    current: list[_Range] = []
    room = piece
    for dst, src in copies:
        nbytes, offset = src.numel(), 0
        while offset < nbytes:
            take = min(room, nbytes - offset)
            current.append((dst, src, offset, take))
            offset += take
            room -= take
            if room == 0:
                pieces.append(current)
                current, room = [], piece
    if current:
        pieces.append(current)
    return pieces


def _drain_work(work: queue.SimpleQueue[list[_Range]], memcpy: bool) -> None:
    """Copy pieces from `work` until it is empty (run by the workers and the caller)."""
    while True:
        try:
            piece = work.get_nowait()
        except queue.Empty:
            return
        for dst, src, start, n in piece:
            _copy_range(dst, src, start, n, memcpy)


def bytewise(t: torch.Tensor) -> bool:
    """Whether `t`'s bytes, as laid out, are its values (so copying them copies it)."""
    return (
        t.layout is torch.strided
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
        and not t.is_quantized
        and t.dtype.itemsize >= 1
    )


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The bytes of contiguous `t`, as a flat uint8 view."""
    return t.detach().reshape(-1).view(torch.uint8)


class Copies:
    """The copies one `stage` call makes: gathered by the walk, made at its end."""

    __slots__ = ("threads", "cpu_dst", "cpu_src", "large", "large_bytes")

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.cpu_dst: list[torch.Tensor] = []
        self.cpu_src: list[torch.Tensor] = []
        # for the pool: (buffer, source) as flat byte views
        self.large: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.large_bytes = 0


class CopyPool:
    """The threads that copy large CPU tensors, kept between snapshots (a new pool
    after a fork, or to grow)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pool_workers = 0
        self._pool_pid = 0

    @property
    def started(self) -> bool:
        return self._pool is not None

    def workers(self, n: int) -> ThreadPoolExecutor:
        """The kept pool, with at least `n` workers (a new one after a fork or to grow)."""
        if self._pool is None or self._pool_workers < n or self._pool_pid != os.getpid():
            if self._pool is not None and self._pool_pid == os.getpid():
                self._pool.shutdown(wait=False)
            self._pool = ThreadPoolExecutor(n, thread_name_prefix="shardwise-staging")
            self._pool_workers, self._pool_pid = n, os.getpid()
        return self._pool

    def close(self) -> None:
        """Stop the threads (the next `run` that needs them starts them again)."""
        if self._pool is not None and self._pool_pid == os.getpid():
            self._pool.shutdown(wait=True)
        self._pool, self._pool_workers = None, 0

    def run(self, copies: Copies, min_piece_bytes: int) -> None:
        """Make the gathered copies: the small ones by this thread while the pool
        starts on the large ones, which this thread then helps with."""
        threads = copies.threads
        work: queue.SimpleQueue[list[_Range]] = queue.SimpleQueue()
        helpers: list[Future] = []
        memcpy = torch.get_num_threads() > 1  # copy_ would start an OpenMP team per worker
        if copies.large:
            piece = max(min_piece_bytes, -(-copies.large_bytes // (4 * threads)))
            pieces = _pieces(copies.large, piece)
            for p in pieces:
                work.put(p)
            if len(pieces) > 1:
                pool = self.workers(threads - 1)
                n = min(threads, len(pieces)) - 1
                helpers = [pool.submit(_drain_work, work, memcpy) for _ in range(n)]
        try:
            if copies.cpu_dst:
                torch._foreach_copy_(copies.cpu_dst, copies.cpu_src)
            _drain_work(work, memcpy)
        finally:
            for h in helpers:
                h.result()


# -----------------------------------------------------------------------------
# Snapshot a state dict's host values into buffers kept between saves, for `async_save`.
#
# The blocking part of an asynchronous save of host state is this snapshot.
# Buffers are keyed by the value's path in the state dict and reused while its
# shape and dtype stay the same, so from the second save on the snapshot is a
# memcpy into warm memory, not an allocation per save.
#
# A set of buffers belongs to one save at a time: `stage` takes the kept set (or
# starts a new one when it is out, e.g. two threads saving at once) and the save
# hands it back with `release` once it has written every byte. So two saves in one
# process never share bytes, and a loop that saves one state at a time reuses one set.
#
# CUDA tensors are not copied here: they stay where they are, and the save
# copies them through its bounded pinned slabs on a side stream while it writes
# (`engine.save`, `io.write`), signalling when the state is free again.
# `cuda_devices` lists the devices they live on, so the caller can mark its
# streams before it returns.
#
# How the copies are made, cheapest first:
#
# * The walk over the state only gathers (buffer, source) pairs; the copies are
#   made at its end, in batches, so thousands of small tensors cost one
#   `torch._foreach_copy_` call, not a Python call and a `detach` each, and
#   ShardedTensor / DTensor wrappers are reused while they wrap the same buffers.
# * With `threads > 1`, large contiguous CPU tensors are cut into byte ranges
#   copied by a thread pool the stager keeps (`threads - 1` workers) and by the
#   calling thread once it has made the small copies. A worker copies with
#   `copy_` (which releases the GIL) when torch runs single-threaded, else with
#   `memcpy`, so that no worker starts an OpenMP team of its own on top of the
#   others. `threads` is by default `torch.get_num_threads()` (the cores this
#   process was told it may use), at most 8: memory bandwidth is spent by then.
#   With one thread, torch's own `copy_` makes every copy.
# * A buffer is written in full by the copy made right when it is allocated
#   (by the pool for large ones), so its pages are faulted in then and never at
#   a later snapshot; pinned buffers are resident from the start.
# -----------------------------------------------------------------------------

_Parameter = torch.nn.Parameter


@dataclass(eq=False)
class Buffers:
    """One save's host buffers by path, and the wrappers last built around them
    (reused while they wrap the same buffers the same way)."""

    tensors: dict[tuple[Any, ...], torch.Tensor] = field(default_factory=dict)
    sharded: dict[tuple[Any, ...], tuple[weakref.ref, ShardedTensor]] = field(default_factory=dict)
    dtensors: dict[tuple[Any, ...], tuple[torch.Tensor, DTensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.tensors.values())


@dataclass(eq=False)
class Staged:
    """What one `stage` made: the state to save, its CUDA devices (their values stay on
    the device), its other leaves (copied) by dotted path, and the buffers it holds
    until `Stager.release`."""

    state: Any
    cuda_devices: set[int]
    objects: dict[str, Any]
    buffers: Buffers


class Stager:
    """Copies state dicts into host buffers it owns. One per process is enough:
    concurrent saves each get a set of buffers of their own.

    `threads`: how many threads copy large CPU tensors (the caller's included);
    by default `torch.get_num_threads()`, at most 8, read at each `stage`.
    """

    # Contiguous CPU tensors from this size on go to the thread pool (smaller
    # ones are batched in one `_foreach_copy_`); a pool task is at least
    # `_min_piece_bytes`, so a worker's wake-up is paid for.
    _pool_min_bytes = 1 << 20
    _min_piece_bytes = 1 << 20

    def __init__(self, threads: int | None = None) -> None:
        if threads is not None and threads < 1:
            raise InvalidArgumentError(f"threads must be at least 1, got {threads}")
        self.threads = threads
        self._copy_pool = CopyPool()
        self._kept: Buffers | None = Buffers()  # None while a save holds it
        self._lock = threading.Lock()  # guards `_kept`
        self._staging = threading.Lock()  # one walk and one use of the copy pool at a time

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers kept for the next `stage` (none while a save holds them)."""
        kept = self._kept
        return kept.nbytes if kept is not None else 0

    def _threads(self) -> int:
        return self.threads if self.threads is not None else max(1, min(8, torch.get_num_threads()))

    def close(self) -> None:
        """Stop the copy threads (a later `stage` starts them again); buffers are kept."""
        self._copy_pool.close()

    def release(self, staged: Staged) -> None:
        """Hand `staged`'s buffers back: its save no longer reads them (written, or
        failed). They are kept for the next `stage`; a set released while another is
        kept replaces it (the newer matches the state being saved now)."""
        with self._lock:
            self._kept = staged.buffers

    def _take(self) -> Buffers:
        with self._lock:
            buffers, self._kept = self._kept, None
        return buffers if buffers is not None else Buffers()

    @staticmethod
    def _allocate(
        buffers: dict[tuple[Any, ...], torch.Tensor], key: tuple[Any, ...], t: torch.Tensor
    ) -> torch.Tensor:
        buf = buffers[key] = torch.empty(t.shape, dtype=t.dtype)
        return buf

    def _copy(self, key: tuple[Any, ...], t: torch.Tensor, copies: _Walk) -> torch.Tensor:
        """The buffer for `key`, with a copy of `t` into it added to `engine.staging`."""
        buffers = copies.buffers.tensors
        buf = buffers.get(key)
        cls = type(t)
        if (cls is torch.Tensor or cls is _Parameter) and t.is_cpu and t.layout is torch.strided:
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = self._allocate(buffers, key, t)
            if copies.threads > 1 and t.nbytes >= self._pool_min_bytes and bytewise(t):
                copies.large.append((bytes_of(buf), bytes_of(t)))
                copies.large_bytes += t.nbytes
            else:
                copies.cpu_dst.append(buf)
                copies.cpu_src.append(t)
            return buf
        if t.is_cuda:  # copied by the save itself, through its pinned slabs
            buffers.pop(key, None)
            copies.cuda_devices.add(t.get_device())
            return t
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self._allocate(buffers, key, t)
        # other devices, layouts and tensor subclasses: one copy_ each, as it comes
        buf.copy_(t.detach())
        return buf

    def stage(self, state: Any, path: tuple[Any, ...] = ()) -> Staged:
        """A copy of `state` whose tensors live in buffers of this stager that no
        other save holds until `release`.

        ShardedTensor and DTensor wrappers around the same buffers, with the same
        metadata, are the objects an earlier call returned (they held the same data)."""
        buffers = self._take()
        try:
            with self._staging:
                copies = _Walk(self._threads(), buffers)
                staged = self._walk(state, path, copies)
                with torch.no_grad():
                    self._copy_pool.run(copies, self._min_piece_bytes)
        except BaseException:
            with self._lock:  # its bytes are half-written, but nothing reads them
                self._kept = buffers
            raise
        return Staged(staged, copies.cuda_devices, copies.objects, buffers)

    def _walk(self, state: Any, path: tuple[Any, ...], copies: _Walk) -> Any:
        cls = type(state)
        if cls is torch.Tensor or cls is _Parameter:
            return self._copy(path, state, copies)
        if isinstance(state, dict):
            out = {}
            for k, v in state.items():  # the common leaves inline, without a _walk call
                vcls = type(v)
                if vcls is torch.Tensor or vcls is _Parameter:
                    if v.is_cuda:  # the save copies it itself
                        copies.cuda_devices.add(v.get_device())
                        out[k] = v
                    else:
                        out[k] = self._copy(path + (k,), v, copies)
                elif vcls is ShardedTensor:
                    out[k] = self._sharded(path + (k,), v, copies)
                else:
                    out[k] = self._walk(v, path + (k,), copies)
            return out
        if isinstance(state, (list, tuple)) and not hasattr(state, "_fields"):
            return cls(self._walk(v, path + (i,), copies) for i, v in enumerate(state))
        if isinstance(state, ShardedTensor):
            return self._sharded(path, state, copies)
        if isinstance(state, DTensor):
            return self._dtensor(path, state, copies)
        if isinstance(state, LocalPieces):
            held = [p.tensor for p in state.pieces]
            shards = [self._copy(path + (i,), t, copies) for i, t in enumerate(held)]
            if all(x is y for x, y in zip(shards, held)):  # kept on their device
                return state
            return state.with_pieces([p._replace(tensor=t) for p, t in zip(state.pieces, shards)])
        if isinstance(state, torch.Tensor):
            if hasattr(state, "metadata") and hasattr(
                state, "local_shards"
            ):  # legacy ShardedTensor
                return self._walk(from_torch_sharded_tensor(state), path, copies)
            return self._copy(path, state, copies)
        value = copy.deepcopy(state)
        copies.objects[".".join(map(str, path))] = value
        return value

    def _sharded(self, path: tuple[Any, ...], st: ShardedTensor, copies: _Walk) -> Any:
        local = st._shards
        if len(local) == 1:
            shards = [self._copy(path + (0,), local[0], copies)]
        else:
            shards = [self._copy(path + (i,), s, copies) for i, s in enumerate(local)]
        if shards and all(x is y for x, y in zip(shards, local)):  # kept on its device
            return st
        entry = copies.buffers.sharded.get(path)
        if entry is not None:
            source, prev = entry
            if (
                (
                    # the same tensor in the same layout object: an in-place `reshard` gives it
                    # a new one (its staged buffers may be the same objects, so they prove nothing)
                    (source() is st and prev._layout is st._layout)
                    or (
                        learned(prev._layout)
                        and learned(st._layout)
                        and prev._layout == st._layout
                        and prev.rank == st.rank
                        and prev.group is st.group
                        and prev.dtype == st.dtype
                    )
                )
                and not prev.requires_grad
                and len(prev._shards) == len(shards)
                and all(x is y for x, y in zip(prev._shards, shards))
            ):
                return prev
        staged = ShardedTensor(
            st._layout,  # as is: a layout built locally is not learned by staging
            shards,
            st.rank,
            dtype=st.dtype,
            device=torch.device("cpu"),
            group=st.group,
        )
        copies.buffers.sharded[path] = (weakref.ref(st), staged)
        return staged

    def _dtensor(self, path: tuple[Any, ...], dt: DTensor, copies: _Walk) -> Any:
        local = dt._local_tensor
        if isinstance(local, LocalShardsWrapper):
            held = local.local_shards()
            shards = [self._copy(path + (i,), s, copies) for i, s in enumerate(held)]
            if shards and all(x is y for x, y in zip(shards, held)):  # kept on its device
                return dt
            offsets = [tuple(o) for o in local.local_offsets()] if shards else []
            staged: torch.Tensor = LocalShardsWrapper(shards, offsets)
        else:
            staged = self._copy(path, local, copies)
            if staged is local:  # kept on its device
                return dt
            prev = copies.buffers.dtensors.get(path)
            if (
                prev is not None
                and prev[0] is staged
                and prev[1].device_mesh is dt.device_mesh
                and prev[1].placements == dt.placements
                and prev[1].shape == dt.shape
                and prev[1].stride() == dt.stride()
                and not prev[1].requires_grad
            ):
                return prev[1]
        out = DTensor.from_local(
            staged,
            dt.device_mesh,
            dt.placements,
            run_check=False,
            shape=dt.shape,
            stride=dt.stride(),
        )
        if not isinstance(local, LocalShardsWrapper):
            copies.buffers.dtensors[path] = (staged, out)  # its local tensor is a view of staged
        return out


class _Walk(Copies):
    """The copies of one `stage`, with what its walk found besides: the buffers it
    fills, the CUDA devices it left values on, the objects it copied."""

    __slots__ = ("buffers", "cuda_devices", "objects")

    def __init__(self, threads: int, buffers: Buffers) -> None:
        super().__init__(threads)
        self.buffers = buffers
        self.cuda_devices: set[int] = set()
        self.objects: dict[str, Any] = {}
