"""A data file's records written from device memory through bounded host slabs.

One pipeline, one thread driving it, three engines kept busy at once:

* the copy engine: device tensors are copied into free slabs (`HostSlabs`) on a
  side stream (`device_copies`) as far ahead as the slabs allow — large ones
  in slab-sized pieces, small ones packed on the device and copied in one go;
* a checksum thread: each slab's large pieces are checksummed tile by tile
  (`TileHasher`, crc32c releases the GIL) while
* writer threads: this thread queues the slab's bytes in the data file and
  hands them to a writer (`DataFile.flush_behind`: `pwritev` at their place in
  the file, several slabs at once on a local disk); once written and
  checksummed the slab is given back and filled again.

Records keep their order (the plan placed every offset before a byte was
written); objects and host tensors are written as they come, between the
staged ones. Host memory stays within the slabs whatever the state's size: a
state larger than the budget is staged in waves. `on_staged` is called once
the last device byte is on the host: from then on the state may change.

Nothing here knows about plans or ranks; `engine.saving` hands it one rank's
records in order.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from typing import Any

import torch

from ..format.tile_stream import TileHasher
from .chunk_writer import DataFile, TensorRecord, Written
from .device_copies import PACK_BYTES, Copier, Mark
from .host_slabs import HostSlabs
from .io_threads import writer_pool

__all__ = ["SMALL_BYTES", "write_records"]

SMALL_BYTES = 1 << 20  # device tensors below this are packed whole; larger ones may be cut
_Segment = tuple[int, int, int]  # (record index, offset in the slab, bytes)


class _Slab:
    __slots__ = ("index", "segments", "mark", "next", "hashing", "written")
    written: list[Future]

    def __init__(self, index: int) -> None:
        self.index = index
        self.segments: list[_Segment] = []
        self.mark: Mark | None = None
        self.next = 0  # segments handed to the file so far
        self.hashing: Future | None = None
        self.written = []


class _Pipeline:
    def __init__(
        self,
        files: Sequence[DataFile],
        staged: dict[int, tuple[torch.Tensor, TileHasher]],
        slabs: HostSlabs,
        copier: Copier,
        on_staged: Callable[[], None] | None,
    ) -> None:
        self.files, self.staged, self.slabs, self.copier = files, staged, slabs, copier
        self.on_staged = on_staged
        self.todo = deque(sorted(staged))  # staged records not yet fully copied
        self.placed = 0  # bytes of todo[0] already copied
        self.source: torch.Tensor | None = None  # todo[0]'s bytes where it lives, if large
        self.filling: _Slab | None = None
        self.used = 0
        self.pack: list[torch.Tensor] = []
        self.pack_at = 0
        self.ready: deque[_Slab] = deque()  # copies issued, in record order
        self.writing: deque[_Slab] = deque()  # handed to a writer, in order
        self.hasher_thread = ThreadPoolExecutor(1, thread_name_prefix="shardwise-checksum")

    # -- producing: copies into free slabs --------------------------------------------------

    def fill(self) -> None:
        """Issue copies into free slabs until the slabs or the staged records run out."""
        size = self.slabs.size
        while self.todo:
            if self.filling is None:
                index = self.slabs.take()
                if index is None and self.writing:
                    self._reclaim(self.writing.popleft())
                    index = self.slabs.take()
                if index is None:
                    return
                self.filling, self.used = _Slab(index), 0
            slab, buf = self.filling, self.slabs.buffer(self.filling.index)
            i = self.todo[0]
            tensor = self.staged[i][0]
            n = _nbytes(tensor)
            room = size - self.used
            if n < SMALL_BYTES:  # packed whole, never cut
                if n > room:
                    self._close()
                    continue
                if self.pack and (
                    self.used - self.pack_at + n > PACK_BYTES
                    or tensor.device != self.pack[0].device
                ):
                    self._issue_pack(buf)
                if not self.pack:
                    self.pack_at = self.used
                self.pack.append(self.copier.bytes_of(tensor))
                slab.segments.append((i, self.used, n))
                self.used += n
                self.todo.popleft()
            else:
                self._issue_pack(buf)
                if self.source is None:  # made on the copy stream, dropped once copied
                    self.source = self.copier.bytes_of(tensor)
                src = self.source
                take = min(n - self.placed, room)
                self.copier.to_host(
                    buf[self.used : self.used + take], src[self.placed : self.placed + take]
                )
                slab.segments.append((i, self.used, take))
                self.used += take
                self.placed += take
                if self.placed == n:
                    self.todo.popleft()
                    self.placed, self.source = 0, None
            if self.used == size:
                self._close()
        if self.filling is not None:
            self._close()

    def _issue_pack(self, buf: torch.Tensor) -> None:
        if self.pack:
            self.copier.pack_to_host(buf[self.pack_at : self.used], self.pack)
            self.pack = []

    def _close(self) -> None:
        slab = self.filling
        assert slab is not None
        self._issue_pack(self.slabs.buffer(slab.index))
        slab.mark = self.copier.mark()
        self.ready.append(slab)
        self.filling = None
        if not self.todo and self.on_staged is not None:  # the last copy is issued
            _when_done(self.copier.mark_all(), self.on_staged)  # every device's copies
            self.on_staged = None

    # -- consuming: checksums and writes, slab by slab --------------------------------------

    def _current(self) -> _Slab:
        slab = self.ready[0]
        if slab.hashing is None:
            assert slab.mark is not None
            slab.mark.wait()
            buf = self.slabs.buffer(slab.index)
            large = [
                (self.staged[i][1], _bytes(buf, at, n))
                for i, at, n in slab.segments
                if _nbytes(self.staged[i][0]) >= SMALL_BYTES
            ]
            slab.hashing = self.hasher_thread.submit(_hash, large)
        return slab

    def write(self, i: int, record: TensorRecord) -> None:
        """Queue record `i`'s payload from the slabs it was copied into."""
        tensor, hasher = self.staged[i]
        left = _nbytes(tensor)
        small = left < SMALL_BYTES
        while left:
            slab = self._current()
            j, at, n = slab.segments[slab.next]
            assert j == i, "records are consumed in the order they were staged"
            piece = _bytes(self.slabs.buffer(slab.index), at, n)
            if small:
                hasher.update(piece)
            record.add(piece)
            left -= n
            slab.next += 1
            if slab.next == len(slab.segments):
                self._finish(slab)
        record.end()

    def _finish(self, slab: _Slab) -> None:
        """Every byte of `slab` is queued: write it behind, fill what is free again."""
        slab.written = [f.flush_behind(writer_pool()) for f in self.files if f.pending]
        self.ready.popleft()
        self.writing.append(slab)
        while self.writing and _done(self.writing[0]):
            self._reclaim(self.writing.popleft())
        self.fill()

    def _reclaim(self, slab: _Slab) -> None:
        """Give `slab` back once its bytes are written and checksummed."""
        assert slab.hashing is not None
        for future in slab.written:
            future.result()
        slab.hashing.result()
        self.slabs.give(slab.index)

    def drain(self) -> None:
        """Wait for every copy issued and every checksum started (on success or failure:
        no slab is reused, nor the state released, while the device still copies)."""
        if self.filling is not None:  # copies issued into a slab not closed yet
            self._issue_pack(self.slabs.buffer(self.filling.index))
            self.filling.mark = self.copier.mark()
            self.ready.append(self.filling)
            self.filling = None
        for slab in self.ready:
            if slab.mark is not None:
                slab.mark.wait()
        wait_for([f for s in self.writing for f in s.written])
        self.hasher_thread.shutdown(wait=True)
        self.copier.close()


def write_records(
    files: Sequence[DataFile],
    records: tuple[Sequence[Any], Sequence[int]],
    serialization_id: str,
    slabs: HostSlabs,
    copier: Copier,
    *,
    stage: Callable[[torch.Tensor], bool] | None,
    on_staged: Callable[[], None] | None = None,
) -> list[Written]:
    """Write `records` — (tensors or objects' bytes, index of the file each goes to) —
    into `files`, each file's in order; tensors `stage` picks (None: none) go through
    `slabs` by `copier`, the others straight from memory. `on_staged` is called (from another
    thread, possibly) once the staged tensors' bytes are all on the host; never
    when a copy could not be issued."""
    values, which = records
    staged: dict[int, tuple[torch.Tensor, TileHasher]] = {}
    for i, r in enumerate(values):
        if stage is None:
            break
        if isinstance(r, torch.Tensor) and r.numel() and stage(r):
            staged[i] = (r.detach(), TileHasher(tuple(r.shape), r.element_size()))
    if not staged and on_staged is not None:
        on_staged()
        on_staged = None
    pipeline = _Pipeline(files, staged, slabs, copier, on_staged)
    out: list[Written | TensorRecord] = []
    try:
        pipeline.fill()
        for i, r in enumerate(values):
            file = files[which[i]]
            if i in staged:
                record = file.begin_tensor(r.dtype, tuple(r.shape), serialization_id, staged[i][1])
                pipeline.write(i, record)
                out.append(record)  # its `Written` once every checksum is taken
            elif isinstance(r, torch.Tensor):
                out.append(file.write_tensor(r, serialization_id))
            else:
                out.append(file.write_object(r))
    finally:
        pipeline.drain()
    return [w.written() if isinstance(w, TensorRecord) else w for w in out]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _done(slab: _Slab) -> bool:
    return all(f.done() for f in slab.written) and bool(slab.hashing and slab.hashing.done())


def _bytes(buf: torch.Tensor, at: int, n: int) -> memoryview:
    return buf[at : at + n].numpy().data


def _hash(pieces: list[tuple[TileHasher, memoryview]]) -> None:
    for hasher, piece in pieces:
        hasher.update(piece)


def _when_done(mark: Mark, then: Callable[[], None]) -> None:
    """Call `then` once `mark`'s copies are done, without holding up the writes."""
    if mark.done():
        then()
        return

    def watch() -> None:
        mark.wait()
        then()

    # not a daemon: the interpreter waits for it at exit rather than stopping it inside
    # a CUDA wait (a daemon thread in C++ at finalization aborts the process)
    threading.Thread(target=watch, name="shardwise-staged").start()
