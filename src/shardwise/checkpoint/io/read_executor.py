"""The read executor: every byte that `swc.load`, `Reader` and the offline tools read
from data files.

Callers describe reads as plain data — `ChunkRead` (a box of a stored chunk into a
target) and `RecordRead` (a stored object's bytes, handed on) — and one
`ReadExecutor` runs them. Each data file is opened once and checked to hold every
range read from it (a missing or short file is one `CorruptCheckpointError`,
before any target is touched). Then

* a box that is a whole chunk with a located payload (the manifest says where;
  for a stock record its head is read to find it) goes straight into the
  target's memory, neighbouring chunks of a file in one `preadv` (the small
  frames between them land in scratch), each payload verified;
* a part of a chunk goes through `box_read.read_box`: only the byte runs (with
  verification, the checksum tiles) the part needs — but parts of a one-tile
  chunk, which verifying reads whole anyway, become one whole-chunk read per
  chunk on the path above (`shared_chunks`), or, planned as arrays
  (`GatherRead`), are gathered a window of chunks at a time (`part_gather`);
* a chunk stored through stream extensions, or a strided stock record, is read
  whole and decoded (`record_decode`), its box copied;
* objects are read first, so one refused (an untrusted pickle) stops the load
  before it writes into any target;
* a device target's bytes land in a pinned stand-in and go on to the device on
  a side stream while the next read runs (`device_landing`; a chunk larger than
  a staging slab piece by piece, `streamed_read`); when `run` returns, every
  copy is done.

On an object store (`Folder.wants_prefetch`) every read is planned first and its
byte ranges fetched concurrently, a window at a time (`prefetch_window`), after
the heads of stock records, which planning needs, all at once; locally reads
just run.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint._extension import ExtensionRegistry
from torch.distributed.checkpoint.filesystem import _StorageInfo

from ...errors import CorruptCheckpointError
from ...storage import Folder, RandomAccess
from ..format.manifest import StoredChunk, StoredObject
from ..format.record_read import RecordLayout
from .box_read import box_ranges, check_record, read_box
from .device_landing import DeviceLanding
from .host_slabs import staging_bytes as budget_of
from .part_gather import extents, windows
from .prefetch_window import Job, run_windowed
from .read_locate import locate, open_files
from .read_requests import ChunkRead, GatherRead, RecordRead, end_of
from .record_decode import CONTAINER_ROOM, load_record, untransform
from .shared_chunks import as_whole, read_whole
from .streamed_read import can_stream, read_streamed
from .whole_chunks import Whole, read_span, whole_spans

__all__ = ["ReadExecutor"]


class ReadExecutor:
    """Runs reads against one folder; `bytes_read` counts every byte read from data files.
    `verify=False` skips checksums; `registry` decodes stream extensions;
    `staging_bytes` bounds the pinned memory device targets are filled through
    (`host_slabs.staging_bytes`)."""

    def __init__(
        self,
        folder: Folder,
        *,
        verify: bool = True,
        registry: ExtensionRegistry | None = None,
        staging_bytes: int | None = None,
    ) -> None:
        self.folder = folder
        self.verify = verify
        self.registry = registry
        self.bytes_read = 0
        self._files: dict[str, RandomAccess] = {}
        self._landing = DeviceLanding(budget_of(staging_bytes))
        self._told: list[tuple[ChunkRead, torch.Tensor]] = []  # device targets' `done`, at the end
        self._lock = threading.Lock()  # reads run on several threads (`prefetch_window`)

    def run(self, reads: Sequence[ChunkRead | RecordRead | GatherRead]) -> None:
        self._landing.follow_caller()
        try:
            gathers = [r for r in reads if isinstance(r, GatherRead)]
            open_files(self.folder, reads, self._files, extents(gathers))
            batches = windows(gathers, self.folder, self._files, self.verify, self._count)
            chunks = [r for r in reads if isinstance(r, ChunkRead)]
            layouts = locate(self.folder, self._files, chunks)
            # objects first: one refused stops the load before any target; then the
            # gathers, on this thread: numpy work for the most part, as the cores are
            # busy with the job's other ranks
            jobs = [self._record_job(r) for r in reads if isinstance(r, RecordRead)]
            jobs += [(w.ranges, w.run) for w in batches]
            first = len(jobs)
            wholes: dict[str, list[Whole]] = defaultdict(list)
            shared: dict[tuple[str, int], tuple[list[ChunkRead], RecordLayout]] = {}
            for read in chunks:
                layout = layouts.get(id(read))
                if layout is None or not layout.c_contiguous:
                    jobs.append(self._record_job(read))
                elif read.lengths == layout.shape and not any(read.offsets):
                    wholes[read.info.relative_path].append((read, layout))
                elif read_whole(read, layout, self.verify):
                    where = (read.info.relative_path, read.info.offset)
                    shared.setdefault(where, ([], layout))[0].append(read)
                else:
                    jobs.append(self._box_job(read, layout))
            for (name, _), (parts, layout) in shared.items():
                wholes[name].append((as_whole(parts, layout), layout))
            limit = self._landing.slab_bytes
            for name, batch in wholes.items():
                for lo, hi, span in whole_spans(batch, limit):
                    jobs.append(({name: [(lo, hi)]}, _bind(self._read_span, name, span, lo)))
            # a caller's callbacks (DCP's planner resolving and committing targets) are
            # called from one thread, as DCP calls them
            called = any(
                r.done is not None or not isinstance(r.target, torch.Tensor) for r in chunks
            )
            run_windowed(self.folder, jobs, ordered=first, threads=1 if called else 8)
        finally:
            try:
                self._landing.finish()  # every device copy done, even after a failed read
            finally:
                for f in self._files.values():
                    f.close()
                self._files.clear()
        told, self._told = self._told, []
        for read, target in told:
            assert read.done is not None
            read.done(target)

    # -- running --------------------------------------------------------------------------------

    def _pread(self, info: _StorageInfo, name: str) -> bytes:
        data = self._files[info.relative_path].pread(info.length, info.offset)
        self._count(len(data))
        if len(data) != info.length:
            raise CorruptCheckpointError(
                f"'{name}': short read of bytes {info.offset}..{end_of(info)} of "
                f"{self.folder.where(info.relative_path)}: truncated"
            )
        return data

    def _count(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n

    def _resolve(self, read: ChunkRead) -> torch.Tensor:
        given = read.target
        target = given if isinstance(given, torch.Tensor) else given().detach()
        if target.shape != read.lengths:
            raise CorruptCheckpointError(
                f"'{read.name}' in {self.folder.where(read.info.relative_path)}: "
                "stored chunk has the wrong size"
            )
        return target

    def _fill(self, read: ChunkRead, target: torch.Tensor, got: torch.Tensor) -> None:
        if got is target:
            pass
        elif target.device.type != "cpu" and self._landing.owns(got):
            self._landing.send(target, got)
        elif target.device.type != "cpu":
            self._landing.copy(target, got)
        else:
            target.copy_(got)
        if read.done is not None:
            if target.device.type == "cpu":
                read.done(target)
            else:  # told once its copy is done
                self._told.append((read, target))

    def _scratch(self, target: torch.Tensor, layout: RecordLayout) -> torch.Tensor:
        """Where a chunk bound for `target` is read when not into it: a pinned stand-in
        for a device target (host memory otherwise, or when it exceeds a slab)."""
        if target.device.type != "cpu":
            host = self._landing.stand_in(layout.shape, layout.dtype)
            if host is not None:
                return host
        return torch.empty(layout.shape, dtype=layout.dtype)

    def _record_job(self, read: RecordRead | ChunkRead) -> Job:
        """A whole stored record read: an object's, a transformed or strided chunk's."""
        info = read.info
        fn: Any = self._read_record if isinstance(read, RecordRead) else self._read_whole
        return {info.relative_path: [(info.offset, end_of(info))]}, _bind(fn, read)

    def _read_record(self, read: RecordRead) -> None:
        info = read.info
        data = self._pread(info, read.name)
        where = self.folder.where(info.relative_path)
        if isinstance(info, StoredChunk) and self.verify:
            check_record(data, info, where, read.name)
        crc = info.crc32c if isinstance(info, StoredObject) else None
        if crc is not None and self.verify and crc32c.crc32c(data) != crc:
            raise CorruptCheckpointError(
                f"object '{read.name}' in {where} bytes {info.offset}..{end_of(info)} "
                "fails its checksum"
            )
        if read.decode and info.transform_descriptors:
            data = untransform(
                self.registry, info.transform_descriptors, data, read.name, str(self.folder), None
            )
        read.use(data)

    def _read_whole(self, read: ChunkRead) -> None:
        """A transformed chunk, or a strided stock record: read whole, checked, decoded."""
        info, where = read.info, self.folder.where(read.info.relative_path)
        data = self._pread(info, read.name)
        if info.transform_descriptors:
            if isinstance(info, StoredChunk) and self.verify:
                check_record(data, info, where, read.name)
            limit = math.prod(read.shape) * read.dtype.itemsize + CONTAINER_ROOM
            data = untransform(
                self.registry, info.transform_descriptors, data, read.name, str(self.folder), limit
            )
        whole = load_record(data, read.name, where)
        piece = whole[tuple(slice(o, o + n) for o, n in zip(read.offsets, read.lengths))]
        target = self._resolve(read)
        if tuple(piece.shape) != tuple(target.shape):
            raise CorruptCheckpointError(
                f"'{read.name}' in {where}: stored chunk has the wrong size"
            )
        self._fill(read, target, piece.contiguous() if target.device.type != "cpu" else piece)

    def _box_job(self, read: ChunkRead, layout: RecordLayout) -> Job:
        name = read.info.relative_path
        chunk = read.info if isinstance(read.info, StoredChunk) else None
        ranges = (
            {name: box_ranges(chunk, layout, read.offsets, read.lengths, self.verify)}
            if self.folder.wants_prefetch
            else {}
        )
        return ranges, lambda: self._read_box(read, chunk, layout)

    def _read_box(self, read: ChunkRead, chunk: StoredChunk | None, layout: RecordLayout) -> None:
        name = read.info.relative_path
        target = self._resolve(read)
        dest = target
        if target.device.type != "cpu":  # read into a stand-in when the box fits a slab
            host = self._landing.stand_in(read.lengths, layout.dtype)
            dest = target if host is None else host
        got, n = read_box(
            self._files[name],
            self.folder.where(name),
            read.name,
            chunk,
            layout,
            read.offsets,
            read.lengths,
            dest,
            self.verify,
        )
        self._count(n)
        if dest is not target and got is not dest:  # read elsewhere: the stand-in is unused
            self._landing.drop(dest)
        self._fill(read, target, got)

    def _read_span(self, name: str, span: list[Whole], lo: int) -> None:
        where = self.folder.where(name)
        if len(span) == 1 and span[0][1].payload_length > self._landing.slab_bytes:
            read, layout = span[0]
            target = self._resolve(read)
            chunk = read.info if isinstance(read.info, StoredChunk) else None
            if target.device.type != "cpu" and can_stream(chunk, layout, target, self.verify):
                self._count(
                    read_streamed(
                        self._files[name],
                        where,
                        read.name,
                        chunk,
                        layout,
                        target,
                        self._landing,
                        self.verify,
                    )
                )
                self._fill(read, target, target)
                return
        got, placed = read_span(
            self._files[name], where, span, lo, self._resolve, self.verify, self._scratch
        )
        self._count(got)
        for read, target, dest in placed:
            self._fill(read, target, dest)


def _bind(fn: Callable[..., None], *args: Any) -> Callable[[], None]:
    return lambda: fn(*args)
