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
  verification, the checksum tiles) the part needs;
* a chunk stored through stream extensions, or a strided stock record, is read
  whole and decoded (`record_decode`), its box copied;
* objects are read first, so one refused (an untrusted pickle) stops the load
  before it writes into any target.

On an object store (`Folder.wants_prefetch`) every read is planned first and its
byte ranges fetched concurrently, a window at a time (`prefetch_window`), after
the heads of stock records, which planning needs, all at once; locally reads
just run.
"""

from __future__ import annotations

import math
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
from ..format.record_read import HEAD_BYTES, RecordLayout, read_record_layout
from .box_read import box_ranges, check_record, read_box
from .prefetch_window import Job as _Job
from .prefetch_window import run_windowed
from .read_requests import ChunkRead, RecordRead, end_of
from .record_decode import CONTAINER_ROOM, load_record, untransform
from .whole_chunks import Whole, read_span, spans

__all__ = ["ReadExecutor"]

_Ranges = dict[str, list[tuple[int, int]]]


class ReadExecutor:
    """Runs reads against one folder; `bytes_read` counts every byte read from data files.
    `verify=False` skips checksums; `registry` decodes stream extensions."""

    def __init__(
        self, folder: Folder, *, verify: bool = True, registry: ExtensionRegistry | None = None
    ) -> None:
        self.folder = folder
        self.verify = verify
        self.registry = registry
        self.bytes_read = 0
        self._files: dict[str, RandomAccess] = {}

    def run(self, reads: Sequence[ChunkRead | RecordRead]) -> None:
        try:
            self._open(reads)
            chunks = [r for r in reads if isinstance(r, ChunkRead)]
            layouts = self._locate(chunks)
            jobs = [self._record_job(r) for r in reads if isinstance(r, RecordRead)]
            wholes: dict[str, list[Whole]] = defaultdict(list)
            for read in chunks:
                layout = layouts.get(id(read))
                if layout is None or not layout.c_contiguous:
                    jobs.append(self._record_job(read))
                elif read.lengths == layout.shape and not any(read.offsets):
                    wholes[read.info.relative_path].append((read, layout))
                else:
                    jobs.append(self._box_job(read, layout))
            for name, batch in wholes.items():
                for lo, hi, span in spans(batch):
                    jobs.append(({name: [(lo, hi)]}, _bind(self._read_span, name, span, lo)))
            run_windowed(self.folder, jobs)
        finally:
            for f in self._files.values():
                f.close()
            self._files.clear()

    # -- opening and locating -------------------------------------------------------------------

    def _open(self, reads: Sequence[ChunkRead | RecordRead]) -> None:
        """Open every file read, once; refuse a missing one, or one too short for a range."""
        last: dict[str, ChunkRead | RecordRead] = {}
        for r in reads:
            name = r.info.relative_path
            seen = last.get(name)
            if seen is None or end_of(r.info) > end_of(seen.info):
                last[name] = r
        for name, r in last.items():
            try:
                f = self._files[name] = self.folder.open(name)
            except FileNotFoundError as e:
                raise CorruptCheckpointError(
                    f"data file {self.folder.where(name)} is missing"
                ) from e
            size = f.size()
            if end_of(r.info) > size:
                raise CorruptCheckpointError(
                    f"'{r.name}': bytes {r.info.offset}..{end_of(r.info)} of "
                    f"{self.folder.where(name)} lie past its end ({size} bytes): "
                    "the file is truncated"
                )

    def _locate(self, reads: list[ChunkRead]) -> dict[int, RecordLayout]:
        """Where each chunk's payload is, by `id` of its read: from its manifest entry, else
        (stock records) from the record's head, all heads fetched at once on a store.
        Transformed chunks have none."""
        layouts: dict[int, RecordLayout] = {}
        heads: _Ranges = defaultdict(list)
        pending: list[ChunkRead] = []
        for r in reads:
            info = r.info
            if info.transform_descriptors:
                continue
            if isinstance(info, StoredChunk) and info.payload is not None:
                at, n = info.payload
                layouts[id(r)] = RecordLayout(at, n, r.dtype, r.shape, True)
            else:
                pending.append(r)
                heads[info.relative_path].append(
                    (info.offset, info.offset + min(info.length, HEAD_BYTES))
                )
        if not pending:
            return layouts
        if self.folder.wants_prefetch:
            self.folder.prefetch(heads)
        try:
            found: dict[tuple[str, int], RecordLayout] = {}
            for r in pending:
                name, at = r.info.relative_path, r.info.offset
                layout = found.get((name, at))
                if layout is None:
                    layout = found[(name, at)] = self._record_layout(r)
                layouts[id(r)] = layout
        finally:
            if self.folder.wants_prefetch:
                self.folder.release()
        return layouts

    def _record_layout(self, r: ChunkRead) -> RecordLayout:
        where = self.folder.where(r.info.relative_path)
        try:
            layout = read_record_layout(
                self._files[r.info.relative_path], r.info.offset, r.info.length
            )
        except ValueError as e:
            raise CorruptCheckpointError(f"'{r.name}' in {where}: {e}") from e
        if layout.shape != r.shape:
            raise CorruptCheckpointError(
                f"'{r.name}' in {where}: the record holds shape {layout.shape}, "
                f"its chunk is {r.shape}"
            )
        return layout

    # -- running --------------------------------------------------------------------------------

    def _pread(self, info: _StorageInfo, name: str) -> bytes:
        data = self._files[info.relative_path].pread(info.length, info.offset)
        self.bytes_read += len(data)
        if len(data) != info.length:
            raise CorruptCheckpointError(
                f"'{name}': short read of bytes {info.offset}..{end_of(info)} of "
                f"{self.folder.where(info.relative_path)}: truncated"
            )
        return data

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
        if got is not target:
            target.copy_(got)
        if read.done is not None:
            read.done(target)

    def _record_job(self, read: RecordRead | ChunkRead) -> _Job:
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
        target.copy_(piece)
        self._fill(read, target, target)

    def _box_job(self, read: ChunkRead, layout: RecordLayout) -> _Job:
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
        got, n = read_box(
            self._files[name],
            self.folder.where(name),
            read.name,
            chunk,
            layout,
            read.offsets,
            read.lengths,
            target,
            self.verify,
        )
        self.bytes_read += n
        self._fill(read, target, got)

    def _read_span(self, name: str, span: list[Whole], lo: int) -> None:
        where = self.folder.where(name)
        got, placed = read_span(self._files[name], where, span, lo, self._resolve, self.verify)
        self.bytes_read += got
        for read, target, dest in placed:
            self._fill(read, target, dest)


def _bind(fn: Callable[..., None], *args: Any) -> Callable[[], None]:
    return lambda: fn(*args)
