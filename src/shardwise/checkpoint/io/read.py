"""The read executor: every byte that `swc.load`, `Reader` and the offline tools read.

Each reader hands it plain requests (`io.chunks`); it opens every data file
once and checks it long enough, runs the read jobs in windows on an object
store and on reader threads locally, streams a whole chunk larger than a
staging slab into a device target slab by slab, and decodes whole archives
back into values (stream extensions undone within bounds).
"""

from __future__ import annotations

import io
import math
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension
from torch.distributed.checkpoint.filesystem import _StorageInfo

from ...errors import CorruptCheckpointError, UnsupportedStorageError
from ...storage import Folder, RandomAccess
from ..format import (
    HEAD_BYTES,
    ArchiveLayout,
    StoredChunk,
    StoredObject,
    TileHasher,
    byte_view,
    read_archive_layout,
    settle,
    settle_ranges,
    tile_lengths,
)
from .chunks import (
    ArchiveRead,
    ChunkRead,
    GatherRead,
    PendingChunk,
    Whole,
    as_whole,
    box_ranges,
    check_archive,
    end_of,
    extents,
    read_box,
    read_span,
    read_whole,
    whole_spans,
    windows,
)
from .device import DeviceLanding, reader_pool
from .device import staging_bytes as budget_of

__all__ = [
    "CONTAINER_ROOM",
    "Job",
    "PARALLEL_BYTES",
    "ReadExecutor",
    "WINDOW",
    "can_stream",
    "load_archive",
    "locate",
    "open_files",
    "read_streamed",
    "run_windowed",
    "untransform",
]


# -----------------------------------------------------------------------------
# Before a read executor reads: every data file opened once and checked long enough,
# and every chunk's payload located (from the manifest, or a stock record's head).
# -----------------------------------------------------------------------------

_Ranges = dict[str, list[tuple[int, int]]]


def open_files(
    folder: Folder,
    reads: Sequence[ChunkRead | ArchiveRead | GatherRead],
    files: dict[str, RandomAccess],
    ends: dict[str, tuple[int, int, str]],
) -> None:
    """Open every file read, once, into `files`; refuse a missing one, or one too short
    for a range. `ends`: the gathers' last record in each file, and its key."""
    last: dict[str, tuple[int, int, str]] = {}  # name -> (start, end, key) of its last range
    for r in reads:
        if isinstance(r, GatherRead):
            continue
        name = r.info.relative_path
        seen = last.get(name)
        if seen is None or end_of(r.info) > seen[1]:
            last[name] = (r.info.offset, end_of(r.info), r.name)
    for name, (start, end, key) in ends.items():
        seen = last.get(name)
        if seen is None or end > seen[1]:
            last[name] = (start, end, key)
    for name, (start, end, key) in last.items():
        try:
            f = files[name] = folder.open(name)
        except FileNotFoundError as e:
            raise CorruptCheckpointError(f"data file {folder.where(name)} is missing") from e
        size = f.size()
        if end > size:
            raise CorruptCheckpointError(
                f"'{key}': bytes {start}..{end} of {folder.where(name)} lie past its end "
                f"({size} bytes): the file is truncated"
            )


def locate(
    folder: Folder, files: dict[str, RandomAccess], reads: list[ChunkRead]
) -> dict[int, ArchiveLayout]:
    """Where each chunk's payload is, by `id` of its read: from its manifest entry, else
    (stock records) from the record's head, all heads fetched at once on a store.
    Transformed chunks have none."""
    layouts: dict[int, ArchiveLayout] = {}
    heads: _Ranges = defaultdict(list)
    pending: list[ChunkRead] = []
    for r in reads:
        info = r.info
        if info.transform_descriptors:
            continue
        if isinstance(info, StoredChunk) and info.payload is not None:
            at, n = info.payload
            layouts[id(r)] = ArchiveLayout(at, n, r.dtype, r.shape, True)
        else:
            pending.append(r)
            heads[info.relative_path].append(
                (info.offset, info.offset + min(info.length, HEAD_BYTES))
            )
    if not pending:
        return layouts
    if folder.wants_prefetch:
        folder.prefetch(heads)
    try:
        found: dict[tuple[str, int], ArchiveLayout] = {}
        for r in pending:
            name, at = r.info.relative_path, r.info.offset
            layout = found.get((name, at))
            if layout is None:
                layout = found[(name, at)] = _archive_layout(folder, files, r)
            layouts[id(r)] = layout
    finally:
        if folder.wants_prefetch:
            folder.release()
    return layouts


def _archive_layout(folder: Folder, files: dict[str, RandomAccess], r: ChunkRead) -> ArchiveLayout:
    where = folder.where(r.info.relative_path)
    try:
        layout = read_archive_layout(files[r.info.relative_path], r.info.offset, r.info.length)
    except ValueError as e:
        raise CorruptCheckpointError(f"'{r.name}' in {where}: {e}") from e
    if layout.shape != r.shape:
        raise CorruptCheckpointError(
            f"'{r.name}' in {where}: the record holds shape {layout.shape}, its chunk is {r.shape}"
        )
    return layout


# -----------------------------------------------------------------------------
# How a load's read jobs run: windows on an object store, reader threads locally.
#
# Each read job names the byte ranges it needs. On a folder that `wants_prefetch`
# (an object store) the jobs run in windows of `WINDOW` bytes: each window's ranges
# are fetched at once, concurrently (`Folder.prefetch`), its reads run from what
# was fetched, and it is released before the next. Locally, jobs of at least
# `PARALLEL_BYTES` run on reader threads (a local disk or tmpfs reads faster with
# several reads in flight), smaller ones on the caller's thread; the first
# `ordered` jobs (objects, checked before any target is written) run first, alone.
# -----------------------------------------------------------------------------

WINDOW = 64 << 20  # bytes fetched ahead at once from an object store (8 parts in flight)

PARALLEL_BYTES = 4 << 20  # local jobs from this size on go to reader threads

Job = tuple[dict[str, list[tuple[int, int]]], Callable[[], None]]  # (ranges by file, the read)


def run_windowed(folder: Folder, jobs: list[Job], ordered: int = 0, threads: int = 8) -> None:
    """Run `jobs`: on an object store in order, each window's ranges fetched at once
    first; locally the first `ordered` in order, then the rest on up to `threads`
    reader threads (the large ones). The first failure, in job order, is raised once
    every job started has ended."""
    if not folder.wants_prefetch:
        _run_local(jobs, ordered, threads)
        return
    start = 0
    while start < len(jobs):
        end, size = start, 0
        window: dict[str, list[tuple[int, int]]] = defaultdict(list)
        while end < len(jobs) and (end == start or size < WINDOW):
            for name, ranges in jobs[end][0].items():
                window[name] += ranges
                size += sum(e - s for s, e in ranges)
            end += 1
        folder.prefetch(window)
        try:
            for _ranges, read in jobs[start:end]:
                read()
        finally:
            folder.release()
        start = end


def _run_local(jobs: list[Job], ordered: int, threads: int) -> None:
    for _ranges, read in jobs[:ordered]:
        read()
    pool = reader_pool() if threads > 1 else None
    started: list[Future] = []
    try:
        for ranges, read in jobs[ordered:]:
            if pool is None or _size(ranges) < PARALLEL_BYTES:
                read()
                continue
            running = [f for f in started if not f.done()]
            if len(running) >= threads:  # at most `threads` in flight
                wait_for(running, return_when="FIRST_COMPLETED")
            started.append(pool.submit(read))
    finally:
        wait_for(started)
    for future in started:
        future.result()


def _size(ranges: dict[str, list[tuple[int, int]]]) -> int:
    return sum(e - s for spans in ranges.values() for s, e in spans)


# -----------------------------------------------------------------------------
# Whole records turned back into values: stream extensions undone (bounded), tensors unpickled.
#
# A chunk stored through DCP's stream extensions (e.g. zstd) or as a strided
# `torch.save` record cannot be read by byte ranges: the read executor reads its
# record whole and decodes it here. Undoing extensions is bounded, so a crafted
# record cannot expand without limit (a decompression bomb).
# -----------------------------------------------------------------------------

# What a `torch.save` container adds around a tensor's bytes, at most (its pickle, zip
# headers and alignment take a few KiB): the bound on undoing a chunk's stream extensions.
CONTAINER_ROOM = 1 << 20


def untransform(
    registry: ExtensionRegistry | None,
    descriptors: Sequence[str],
    data: bytes,
    name: str,
    where: str,
    limit: int | None,
) -> bytes:
    """`data` with the stream extensions `descriptors` undone, refused past `limit` bytes
    (None: unbounded, for objects, whose size is not recorded)."""
    try:
        extensions = (registry or ExtensionRegistry()).from_descriptor_list(list(descriptors))
    except ValueError as e:  # DCP's "Unknown extension": not damage, a missing registry
        raise UnsupportedStorageError(
            f"'{name}' in {where} was written through stream extensions {list(descriptors)} "
            f"this reader does not know ({e}); pass a registry that does: "
            "Reader(path, _extension_registry=...), swc.load(..., extension_registry=...) "
            "or read_tensor(..., extension_registry=...)"
        ) from e
    stream: Any = io.BytesIO(data)
    for ex in extensions:
        if isinstance(ex, StreamTransformExtension):
            stream = ex.transform_from(stream)
    plain: bytes = stream.read(-1 if limit is None else limit + 1)
    if limit is not None and len(plain) > limit:
        raise CorruptCheckpointError(
            f"'{name}' in {where}: undoing its stream extensions yields over {limit} bytes, "
            "more than its chunk's elements and a torch.save container need: a "
            "decompression bomb, or damaged; refused"
        )
    return plain


def load_archive(data: bytes, name: str, where: str) -> torch.Tensor:
    """The tensor of a whole `torch.save` record (tensors only: `weights_only`)."""
    try:
        value = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any decoding failure means damaged bytes
        raise CorruptCheckpointError(f"'{name}' in {where}: cannot decode ({e})") from e
    if not isinstance(value, torch.Tensor):
        raise CorruptCheckpointError(f"'{name}' in {where}: the record holds no tensor")
    return value


# -----------------------------------------------------------------------------
# A whole chunk larger than a staging slab, read into a device target slab by slab.
#
# Each slab-sized piece of the payload is read into a pinned stand-in
# (`io.device`), checksummed as it comes (`TileHasher`: the same tiles the
# writer took) and sent to its place in the target on the side stream while the
# next piece is read. Host memory stays within the slabs however large the
# chunk. The target holds the bytes before they are all verified (as a direct
# read into a host target does); a failed tile raises `CorruptCheckpointError`
# naming the tensor, the file and the bytes.
# -----------------------------------------------------------------------------


def can_stream(
    chunk: StoredChunk | None, layout: ArchiveLayout, target: torch.Tensor, verify: bool
) -> bool:
    """Whether a whole chunk can go to `target` piecewise: a contiguous target of the
    stored dtype, and checksums (if any are checked) in the writer's tiles."""
    if not (target.is_contiguous() and target.dtype == layout.dtype and layout.c_contiguous):
        return False
    if not verify or chunk is None or chunk.crcs is None or chunk.payload is None:
        return True
    tile = TileHasher(layout.shape, layout.dtype.itemsize).tile
    return chunk.tile is not None and tuple(chunk.tile) == tile


def read_streamed(
    file: RandomAccess,
    where: str,
    name: str,
    chunk: StoredChunk | None,
    layout: ArchiveLayout,
    target: torch.Tensor,
    landing: DeviceLanding,
    verify: bool,
) -> int:
    """Read the chunk's payload into `target` (`can_stream` holds); the bytes read."""
    checked = verify and chunk is not None and chunk.crcs is not None and chunk.payload is not None
    hasher = TileHasher(layout.shape, layout.dtype.itemsize) if checked else None
    flat = target.view(-1).view(torch.uint8) if target.numel() else target
    total, piece, at = flat.numel(), landing.slab_bytes, 0
    while at < total:
        n = min(piece, total - at)
        host = landing.stand_in((n,), torch.uint8)
        staged = host is not None
        if host is None:  # every slab is held by other reads: this piece goes through scratch
            host = torch.empty(n, dtype=torch.uint8)
        view = byte_view(host)
        got = file.readinto([view], layout.payload_offset + at)
        if got != n:
            raise CorruptCheckpointError(
                f"'{name}': short read of bytes {layout.payload_offset + at}.."
                f"{layout.payload_offset + at + n} of {where}: truncated"
            )
        if hasher is not None:
            hasher.update(view)
        if staged:
            landing.send(flat[at : at + n], host)
        else:
            landing.copy(flat[at : at + n], host)
        at += n
    if hasher is not None and chunk is not None and chunk.crcs is not None:
        _check(hasher, chunk, layout, where, name)
    return total


def _check(
    hasher: TileHasher, chunk: StoredChunk, layout: ArchiveLayout, where: str, name: str
) -> None:
    tile, crcs = hasher.result()
    expected = list(chunk.crcs or [])
    if crcs == expected:
        return
    bad = next((k for k, (a, b) in enumerate(zip(crcs, expected)) if a != b), len(crcs))
    start = length = 0
    for k, length in enumerate(tile_lengths(layout.shape, layout.dtype.itemsize, tile)):
        if k == bad:
            break
        start += length
    lo = layout.payload_offset + start
    raise CorruptCheckpointError(
        f"'{name}': bytes {lo}..{lo + length} of {where} fail their checksum"
    )


# -----------------------------------------------------------------------------
# The read executor: every byte that `swc.load`, `Reader` and the offline tools read
# from data files.
#
# Callers describe reads as plain data — `ChunkRead` (a box of a stored chunk into a
# target) and `ArchiveRead` (a stored object's bytes, handed on) — and one
# `ReadExecutor` runs them. Each data file is opened once and checked to hold every
# range read from it (a missing or short file is one `CorruptCheckpointError`,
# before any target is touched). Then
#
# * a box that is a whole chunk with a located payload (the manifest says where;
#   for a stock record its head is read to find it) goes straight into the
#   target's memory, neighbouring chunks of a file in one `preadv` (the small
#   frames between them land in scratch), each payload verified;
# * a part of a chunk goes through `io.chunks.read_box`: only the byte runs (with
#   verification, the checksum tiles) the part needs — but parts of a one-tile
#   chunk, which verifying reads whole anyway, become one whole-chunk read per
#   chunk on the path above (`io.chunks`), or, planned as arrays
#   (`GatherRead`), are gathered a window of chunks at a time (`io.chunks`);
# * a chunk stored through stream extensions, or a strided stock record, is read
#   whole and decoded (`io.read`), its box copied;
# * objects are read first, so one refused (an untrusted pickle) stops the load
#   before it writes into any target;
# * a device target's bytes land in a pinned stand-in and go on to the device on
#   a side stream while the next read runs (`io.device`; a chunk larger than
#   a staging slab piece by piece, `io.read`); when `run` returns, every
#   copy is done.
#
# On an object store (`Folder.wants_prefetch`) every read is planned first and its
# byte ranges fetched concurrently, a window at a time (`io.read`), after
# the heads of stock records, which planning needs, all at once; locally reads
# just run.
# -----------------------------------------------------------------------------


class ReadExecutor:
    """Runs reads against one folder; `bytes_read` counts every byte read from data files.
    `verify=False` skips checksums; `storage.location` decodes stream extensions;
    `staging_bytes` bounds the pinned memory device targets are filled through
    (`io.device.staging_bytes`). `progress` is called with the bytes of each read
    as it lands (from the reading threads, one call at a time)."""

    def __init__(
        self,
        folder: Folder,
        *,
        verify: bool = True,
        registry: ExtensionRegistry | None = None,
        staging_bytes: int | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.folder = folder
        self.verify = verify
        self.registry = registry
        self.progress = progress
        self.bytes_read = 0
        self._files: dict[str, RandomAccess] = {}
        self._landing = DeviceLanding(budget_of(staging_bytes))
        self._told: list[tuple[ChunkRead, torch.Tensor]] = []  # device targets' `done`, at the end
        self._lock = threading.Lock()  # reads run on several threads (`io.read`)
        self._telling = threading.Lock()  # `progress`, called by one thread at a time

    def run(
        self,
        reads: Sequence[ChunkRead | ArchiveRead | GatherRead],
        settling: Sequence[PendingChunk] = (),
    ) -> None:
        """Run `reads`; the checksums of `settling` (chunks later runs read) are fetched
        with theirs, first."""
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
            jobs = [self._archive_job(r) for r in reads if isinstance(r, ArchiveRead)]
            jobs += [(w.ranges, w.run) for w in batches]
            first = len(jobs)
            wholes: dict[str, list[Whole]] = defaultdict(list)
            shared: dict[tuple[str, int], tuple[list[ChunkRead], ArchiveLayout]] = {}
            for read in chunks:
                layout = layouts.get(id(read))
                if layout is None or not layout.c_contiguous:
                    jobs.append(self._archive_job(read))
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
            pending = self._pending([r.info for r in chunks], settling)
            if pending:  # before any read: on a store, fetched with the first window's data
                jobs.insert(0, pending)
                first += 1
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

    def _pending(self, infos: list[_StorageInfo], settling: Sequence[PendingChunk]) -> Job | None:
        """The job that fetches the checksums of the chunks `infos` and `settling` name
        planned without them (`PendingChunk`), when verifying: its ranges (on a store,
        fetched with the data they check, in one request where they are neighbours) and
        the fetch."""
        if not self.verify:
            return None
        found: dict[int, PendingChunk] = {}
        for i in [*infos, *settling]:
            if isinstance(i, PendingChunk) and i.crcs is None:
                found.setdefault(id(i), i)
        pending = list(found.values())
        if not pending:
            return None
        unsettled = [i.unsettled for i in pending]
        ranges = settle_ranges(unsettled) if self.folder.wants_prefetch else {}  # type: ignore[arg-type]

        def fetch() -> None:
            for info, entry in zip(pending, settle(unsettled), strict=True):  # type: ignore[arg-type]
                info.crcs = list(entry.crcs)

        return ranges, fetch

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
        if self.progress is not None:
            with self._telling:  # one call at a time, never holding up the count
                self.progress(n)

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

    def _scratch(self, target: torch.Tensor, layout: ArchiveLayout) -> torch.Tensor:
        """Where a chunk bound for `target` is read when not into it: a pinned stand-in
        for a device target (host memory otherwise, or when it exceeds a slab)."""
        if target.device.type != "cpu":
            host = self._landing.stand_in(layout.shape, layout.dtype)
            if host is not None:
                return host
        return torch.empty(layout.shape, dtype=layout.dtype)

    def _archive_job(self, read: ArchiveRead | ChunkRead) -> Job:
        """A whole stored record read: an object's, a transformed or strided chunk's."""
        info = read.info
        fn: Any = self._read_archive if isinstance(read, ArchiveRead) else self._read_whole
        return {info.relative_path: [(info.offset, end_of(info))]}, _bind(fn, read)

    def _read_archive(self, read: ArchiveRead) -> None:
        info = read.info
        data = self._pread(info, read.name)
        where = self.folder.where(info.relative_path)
        if isinstance(info, StoredChunk) and self.verify:
            check_archive(data, info, where, read.name)
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
                check_archive(data, info, where, read.name)
            limit = math.prod(read.shape) * read.dtype.itemsize + CONTAINER_ROOM
            data = untransform(
                self.registry, info.transform_descriptors, data, read.name, str(self.folder), limit
            )
        whole = load_archive(data, read.name, where)
        piece = whole[tuple(slice(o, o + n) for o, n in zip(read.offsets, read.lengths))]
        target = self._resolve(read)
        if tuple(piece.shape) != tuple(target.shape):
            raise CorruptCheckpointError(
                f"'{read.name}' in {where}: stored chunk has the wrong size"
            )
        self._fill(read, target, piece.contiguous() if target.device.type != "cpu" else piece)

    def _box_job(self, read: ChunkRead, layout: ArchiveLayout) -> Job:
        name = read.info.relative_path
        chunk = read.info if isinstance(read.info, StoredChunk) else None
        ranges = (
            {name: box_ranges(chunk, layout, read.offsets, read.lengths, self.verify)}
            if self.folder.wants_prefetch
            else {}
        )
        return ranges, lambda: self._read_box(read, chunk, layout)

    def _read_box(self, read: ChunkRead, chunk: StoredChunk | None, layout: ArchiveLayout) -> None:
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
        alone = span[0] if len(span) == 1 else None  # (read, layout) of a span's only chunk
        if alone is not None and alone[1].payload_length > self._landing.slab_bytes:
            read, layout = alone
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
