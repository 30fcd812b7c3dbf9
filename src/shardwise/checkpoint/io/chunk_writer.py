"""Writing a data file record by record: the one place chunk and object bytes are
framed, written and checksummed, for `saving`, `Writer` and `reshard` alike.

A tensor is framed as the `torch.save` record stock DCP reads, its payload
written straight from the tensor's memory and checksummed tile by tile while in
cache; records are queued and written many per `writev`, host copies of non-CPU
tensors held up to `_BATCH_BYTES` at a time. One writer keeps every producer's
files and manifests byte-identical.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from types import TracebackType
from typing import Any, NamedTuple

import crc32c
import torch

from ...errors import InvalidArgumentError
from ...storage import Folder, open_folder
from ..format.checksums import byte_view, frame_crc
from ..format.manifest import ChunkEntry, ObjectEntry
from ..format.record_write import record_frame, tensor_record
from ..format.tile_stream import TileHasher
from ..format.tiles import checksum_payload
from .faults import failpoint

__all__ = ["DataFile", "TensorRecord", "Written", "payload_checksums"]

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
    plain = tensor.resolve_conj().resolve_neg()  # the values, as `tensor_record` stores them
    payload = byte_view(plain) if plain.numel() else memoryview(b"")
    return checksum_payload(payload, tuple(plain.shape), plain.element_size())


class DataFile:
    """A new data file in `folder`, filled with records in order, then `finish`ed
    (synced when asked) and closed; leaving its `with` block on an error removes it.

    It is created exclusively: a save never changes a file it did not write. On an
    object store it becomes visible only when closed without an error. Records are
    queued and written in batches: `Written` says where each will be.

    Failpoints (`faults`): "mid-data" after the file's first write, "after-data"
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
        return self.write_record(data)

    def write_record(self, data: Any) -> Written:
        """An already-encoded record (an object's bytes, a stream-transformed chunk)
        stored as it is, with one checksum of the whole range."""
        self._queue((data,), len(data), len(data))
        return self._advance(len(data), [crc32c.crc32c(data)])

    def write_tensor(self, tensor: torch.Tensor, serialization_id: str = "0" * 40) -> Written:
        """A tensor (any device, any strides) as the `torch.save` record stock DCP reads,
        its payload written from a contiguous CPU tensor's own memory and checksummed
        tile by tile (`tiles`)."""
        source = tensor.detach()
        tensor = source.cpu().contiguous()
        copied = tensor.nbytes if tensor.data_ptr() != source.data_ptr() else 0
        head, payload, tail = tensor_record(tensor, serialization_id)
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
    ) -> TensorRecord:
        """A tensor record whose payload comes in pieces (`TensorRecord.add`): a device
        tensor staged through host buffers, written the same bytes `write_tensor` would.
        Its place in the file is taken now; nothing else is written until it `end`s."""
        head, tail = record_frame(dtype, shape, serialization_id)
        record = TensorRecord(self, dtype, shape, head, tail, hasher)
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


class TensorRecord:
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
