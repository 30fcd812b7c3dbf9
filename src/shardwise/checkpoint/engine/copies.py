"""The copies of one snapshot, made in bulk: batched small copies, large CPU tensors cut
into byte ranges for a kept thread pool (see `staging`).

Split from `staging` so that the walk over a state (what to copy where) and the
machinery that moves the bytes (how) read separately.
"""

from __future__ import annotations

import ctypes
import os
import queue
from concurrent.futures import Future, ThreadPoolExecutor

import torch

__all__ = ["CopyPool", "Copies", "bytes_of", "bytewise"]

# A byte range of one copy: destination and source (flat uint8 views), offset, byte count.
_Range = tuple[torch.Tensor, torch.Tensor, int, int]


def _copy_range(dst: torch.Tensor, src: torch.Tensor, start: int, n: int, memcpy: bool) -> None:
    if memcpy:
        ctypes.memmove(dst.data_ptr() + start, src.data_ptr() + start, n)
    else:
        dst[start : start + n].copy_(src[start : start + n])


def _pieces(copies: list[tuple[torch.Tensor, torch.Tensor]], piece: int) -> list[list[_Range]]:
    """Cut the concatenation of the (destination, source) byte views in `copies`
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
