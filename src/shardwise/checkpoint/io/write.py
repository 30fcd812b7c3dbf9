"""Writing a data file: the one place chunk and object bytes are written.

A data file is written archive by archive (`DataFile`), its checksums computed
as the bytes pass; tensors on a device are staged through bounded host slabs
on a side stream, so a save never makes a pageable copy of its state.
"""

from __future__ import annotations

import math
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from types import TracebackType
from typing import Any, NamedTuple

import crc32c
import torch

from ...errors import InvalidArgumentError
from ...storage import Folder, open_folder
from ..format import (
    ChunkEntry,
    ObjectEntry,
    TileHasher,
    archive_frame,
    byte_view,
    checksum_payload,
    frame_crc,
    tensor_archive,
)
from .commit import failpoint
from .device import PACK_BYTES, Copier, HostSlabs, Mark, writer_pool

__all__ = [
    "DataFile",
    "SMALL_BYTES",
    "TensorArchive",
    "Written",
    "payload_checksums",
    "write_archives",
]


# -----------------------------------------------------------------------------
# Writing a data file record by record: the one place chunk and object bytes are
# framed, written and checksummed, for `engine.save`, `Writer` and `reshard` alike.
#
# A tensor is framed as the `torch.save` record stock DCP reads, its payload
# written straight from the tensor's memory and checksummed tile by tile while in
# cache; records are queued and written many per `writev`, host copies of non-CPU
# tensors held up to `_BATCH_BYTES` at a time. One writer keeps every producer's
# files and manifests byte-identical.
# -----------------------------------------------------------------------------

_BATCH_BYTES = 64 << 20  # host copies (of non-CPU tensors, objects) held before a write

_BATCH_BUFFERS = 1023  # buffers per write (a `writev`: IOV_MAX is 1024)


class Written(NamedTuple):
    """Where one item went in a data file, and its checksums: what the manifest records
    (a NamedTuple: a save makes one per record, 100,000 of them at scale)."""

    file: str
    offset: int
    length: int
    crcs: list[int]  # of the payload's tiles (pages when `tile` is None); one, of the whole range,
    # for an object or a transformed record
    payload: tuple[int, int] | None = None  # a tensor record's raw C-order bytes
    frame: int = 0  # crc32c of a tensor record's bytes around its payload
    tile: tuple[int, ...] | None = None  # the tile shape of `crcs`; None: pages, or one crc

    def chunk_entry(
        self, offsets: tuple[int, ...], sizes: tuple[int, ...], transform: list[str] | None = None
    ) -> ChunkEntry:
        return ChunkEntry(
            offsets,
            sizes,
            self.file,
            (self.offset, self.length),
            self.payload,
            self.crcs,
            self.frame,
            transform,
            self.tile,
        )

    def object_entry(self, transform: list[str] | None = None) -> ObjectEntry:
        return ObjectEntry(self.file, self.offset, self.length, self.crcs[0], transform)


def payload_checksums(tensor: torch.Tensor) -> tuple[tuple[int, ...], list[int]]:
    """(tile shape, crc32c of each tile) of a contiguous CPU tensor's payload, read in
    place: what the manifest records for the chunk it is stored as."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise InvalidArgumentError("payload_checksums needs a contiguous CPU tensor")
    plain = tensor.resolve_conj().resolve_neg()  # the values, as `tensor_archive` stores them
    payload = byte_view(plain) if plain.numel() else memoryview(b"")
    return checksum_payload(payload, tuple(plain.shape), plain.element_size())


class DataFile:
    """A new data file in `folder`, filled with records in order, then `finish`ed
    (synced when asked) and closed; leaving its `with` block on an error removes it.

    It is created exclusively: a save never changes a file it did not write. On an
    object store it becomes visible only when closed without an error. Records are
    queued and written in batches: `Written` says where each will be.

    Failpoints (`io.commit`): "mid-data" after the file's first write, "after-data"
    once `finish` has closed it."""

    def __init__(self, folder: Folder | str | os.PathLike, name: str) -> None:
        self.name = name
        self.pos = 0
        self._sink = open_folder(folder).create(name)
        self._pending: list[Any] = []
        self._held = 0  # bytes of host copies in `_pending`
        self._at = 0  # where the first pending byte goes
        self._queued = 0  # bytes pending
        self._behind: list[Future] = []  # writes running on other threads (`flush_behind`)
        self._wrote = False
        self._closed = False

    def __enter__(self) -> DataFile:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if kind is None and not self._closed:
            try:
                self._flush()
                self._wait_behind()
                self._sink.close(sync=False)
            except BaseException:
                self._abort()
                raise
        elif kind is not None:
            self._abort()

    def _abort(self) -> None:
        wait_for(self._behind)  # no thread still writes into what is removed
        self._sink.abort()  # nothing half-written stays

    def finish(self, sync: bool = True) -> None:
        """Write what is queued and close the file, durable (fsync; on an object store,
        the upload completed) when `sync`."""
        self._flush()
        self._wait_behind()
        self._sink.close(sync=sync)
        self._closed = True
        failpoint("after-data")

    def write_object(self, data: Any) -> Written:
        """Bytes stored as they are (a pickled object), with one checksum."""
        return self.write_archive(data)

    def write_archive(self, data: Any) -> Written:
        """An already-encoded record (an object's bytes, a stream-transformed chunk)
        stored as it is, with one checksum of the whole range."""
        self._queue((data,), len(data), len(data))
        return self._advance(len(data), [crc32c.crc32c(data)])

    def write_tensor(self, tensor: torch.Tensor, serialization_id: str = "0" * 40) -> Written:
        """A tensor (any device, any strides) as the `torch.save` record stock DCP reads,
        its payload written from a contiguous CPU tensor's own memory and checksummed
        tile by tile (`format.checksums`)."""
        source = tensor.detach()
        tensor = source.cpu().contiguous()
        copied = tensor.nbytes if tensor.data_ptr() != source.data_ptr() else 0
        head, payload, tail = tensor_archive(tensor, serialization_id)
        tile, crcs = checksum_payload(payload, tuple(tensor.shape), tensor.element_size())
        self._queue((head, payload, tail), copied, len(head) + len(payload) + len(tail))
        payload_at = (self.pos + len(head), len(payload))
        length = len(head) + len(payload) + len(tail)
        return self._advance(length, crcs, payload_at, frame_crc(head, tail), tile)

    def begin_tensor(
        self,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        serialization_id: str = "0" * 40,
        hasher: TileHasher | None = None,
    ) -> TensorArchive:
        """A tensor record whose payload comes in pieces (`TensorArchive.add`): a device
        tensor staged through host buffers, written the same bytes `write_tensor` would.
        Its place in the file is taken now; nothing else is written until it `end`s."""
        head, tail = archive_frame(dtype, shape, serialization_id)
        record = TensorArchive(self, dtype, shape, head, tail, hasher)
        self._queue((head,), 0, len(head))
        return record

    @property
    def pending(self) -> bool:
        """Whether buffers are queued, not yet written."""
        return bool(self._pending)

    def flush(self) -> None:
        """Write what is queued now: the queued buffers may then be reused."""
        self._flush()

    def flush_behind(self, pool: ThreadPoolExecutor) -> Future:
        """Write what is queued on one of `pool`'s threads, at its place in the file, while
        this thread goes on: the returned future is done once the queued buffers may be
        reused. Where the storage appends only (object stores), it writes now."""
        if not self._sink.positional:
            self._flush()
            done: Future = Future()
            done.set_result(None)
            return done
        buffers, at = self._take_pending()
        future = pool.submit(self._sink.write_at, buffers, at)
        self._behind.append(future)
        self._first_write()
        return future

    def _queue(self, buffers: tuple[Any, ...], held: int, nbytes: int) -> None:
        self._pending += buffers  # `nbytes` in all, `held` of them in host copies
        self._queued += nbytes
        self._held += held
        if self._held >= _BATCH_BYTES or len(self._pending) >= _BATCH_BUFFERS:
            self._flush()

    def _flush(self) -> None:
        if not self._pending and self._wrote:
            return
        if self._sink.positional:
            buffers, at = self._take_pending()
            self._sink.write_at(buffers, at)
        else:
            self._sink.write(self._pending)
            self._pending, self._held, self._queued = [], 0, 0
        self._first_write()

    def _take_pending(self) -> tuple[list[Any], int]:
        buffers, at = self._pending, self._at
        self._at += self._queued
        self._pending, self._held, self._queued = [], 0, 0
        return buffers, at

    def _first_write(self) -> None:
        if not self._wrote:
            self._wrote = True
            failpoint("mid-data")

    def _wait_behind(self) -> None:
        """Every write handed to another thread done; the first failure raised."""
        wait_for(self._behind)  # all of them ended before any failure is raised
        behind, self._behind = self._behind, []
        for future in behind:
            future.result()

    def _advance(
        self,
        length: int,
        crcs: list[int],
        payload: tuple[int, int] | None = None,
        frame: int = 0,
        tile: tuple[int, ...] | None = None,
    ) -> Written:
        written = Written(self.name, self.pos, length, crcs, payload, frame, tile)
        self.pos += length
        return written


class TensorArchive:
    """One tensor record of a `DataFile` being written piece by piece, in order. The
    pieces are queued, not copied: keep them unchanged until the file is `flush`ed.
    Checksums are taken by the `hasher`, fed by the caller (possibly on another
    thread, overlapping the writes) before `written` is asked."""

    def __init__(
        self,
        file: DataFile,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        head: bytes,
        tail: bytes,
        hasher: TileHasher | None = None,
    ) -> None:
        self.file, self.head, self.tail = file, head, tail
        self.at = file.pos
        self.nbytes = math.prod(shape) * dtype.itemsize
        self.hasher = hasher or TileHasher(shape, dtype.itemsize)
        self._added = 0

    def add(self, piece: memoryview) -> None:
        self._added += len(piece)
        self.file._queue((piece,), 0, len(piece))

    def end(self) -> None:
        """The payload is complete: queue the record's tail and move the file past it."""
        if self._added != self.nbytes:
            raise InvalidArgumentError(
                f"a record of {self.nbytes} payload bytes ended after {self._added}"
            )
        self.file._queue((self.tail,), 0, len(self.tail))
        self.file.pos += len(self.head) + self.nbytes + len(self.tail)

    def written(self) -> Written:
        """Where the record went and its checksums (the hasher fed the whole payload)."""
        tile, crcs = self.hasher.result()
        length = len(self.head) + self.nbytes + len(self.tail)
        payload = (self.at + len(self.head), self.nbytes)
        frame = frame_crc(self.head, self.tail)
        return Written(self.file.name, self.at, length, crcs, payload, frame, tile)


# -----------------------------------------------------------------------------
# A data file's records written from device memory through bounded host slabs.
#
# One pipeline, one thread driving it, three engines kept busy at once:
#
# * the copy engine: device tensors are copied into free slabs (`HostSlabs`) on a
#   side stream (`io.device`) as far ahead as the slabs allow — large ones
#   in slab-sized pieces, small ones packed on the device and copied in one go;
# * a checksum thread: each slab's large pieces are checksummed tile by tile
#   (`TileHasher`, crc32c releases the GIL) while
# * writer threads: this thread queues the slab's bytes in the data file and
#   hands them to a writer (`DataFile.flush_behind`: `pwritev` at their place in
#   the file, several slabs at once on a local disk); once written and
#   checksummed the slab is given back and filled again.
#
# Records keep their order (the plan placed every offset before a byte was
# written); objects and host tensors are written as they come, between the
# staged ones. Host memory stays within the slabs whatever the state's size: a
# state larger than the budget is staged in waves. `on_staged` is called once
# the last device byte is on the host: from then on the state may change.
#
# Nothing here knows about plans or ranks; `engine.save` hands it one rank's
# records in order.
# -----------------------------------------------------------------------------

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

    def write(self, i: int, record: TensorArchive) -> None:
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


def write_archives(
    files: Sequence[DataFile],
    records: tuple[Sequence[Any], Sequence[int]],
    serialization_id: str,
    slabs: HostSlabs,
    copier: Copier,
    *,
    stage: Callable[[torch.Tensor], bool] | None,
    on_staged: Callable[[], None] | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[Written]:
    """Write `records` — (tensors or objects' bytes, index of the file each goes to) —
    into `files`, each file's in order; tensors `stage` picks (None: none) go through
    `slabs` by `copier`, the others straight from memory. `on_staged` is called (from another
    thread, possibly) once the staged tensors' bytes are all on the host; never
    when a copy could not be issued. `progress` is called with each record's bytes
    once it is handed to its file (a staged one: its last slab queued)."""
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
    out: list[Written | TensorArchive] = []
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
            if progress is not None:
                progress(record_bytes(r))
    finally:
        pipeline.drain()
    return [w.written() if isinstance(w, TensorArchive) else w for w in out]


def record_bytes(record: Any) -> int:
    """The payload bytes of a record `write_archives` takes: a tensor's, or an object's."""
    return _nbytes(record) if isinstance(record, torch.Tensor) else len(record)


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
