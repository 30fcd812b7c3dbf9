"""What a checkpoint stores, as every reader sees it: one view of shardwise and stock records.

`StoredView.read` finds a checkpoint's records once — `shardwise.json` (never
unpickling `.metadata`), or a stock `.metadata` through an unpickler that admits
only DCP's classes (also when stock `dcp.save` replaced a shardwise checkpoint in
place), or a rank's own records (`use_collectives=False`) — and answers, per key,
what a load needs: a tensor's shape, dtype and stored chunks (with their storage
info: checksums and payload offsets for shardwise chunks, none for stock ones), or
an object's storage info. The load engine plans from it; `Reader.read_metadata`
is its `metadata()`. Built per key on demand: a load of a few keys of a large
manifest builds nothing for the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from ...errors import CorruptCheckpointError
from ...storage import Folder
from ..format.chunk_table import ChunkTable
from ..format.manifest import (
    MANIFEST,
    Manifest,
    StoredChunk,
    StoredObject,
    dtype_from_name,
)
from ..format.manifest_entries import ChunkEntry
from ..format.manifest_index import (
    Ranges,
    RowSpans,
    TensorChunks,
    check_read_ranges,
    section_bytes,
)
from ..format.record_check import check_name
from ..format.row_boxes import Boxes, one_tile_boxes
from ..format.writer_checksums import fetcher
from ..io.commit import RecordNames, per_rank_records
from .records import read_records
from .whole_rows import Section

__all__ = ["Covering", "Sections", "StoredBox", "StoredView", "read_records"]

# offsets, sizes, and the stored chunk (its manifest entry, or DCP's storage info)
StoredBox = tuple[tuple[int, ...], tuple[int, ...], Any]


class StoredView:
    """A checkpoint's keys as a load plans them, from its manifest or DCP's metadata."""

    def __init__(
        self,
        folder: Folder,
        manifest: Manifest | None,
        metadata: Metadata | None,
        name: str = MANIFEST,
        listing: dict[str, int] | None = None,
    ):
        self.folder = folder
        self.manifest = manifest
        self._metadata = metadata
        self._name = name  # the manifest's, in errors
        self._listing = listing  # the folder's files and sizes when the records were read

    @classmethod
    def read(cls, folder: Folder, rank: int) -> StoredView:
        """The checkpoint at `folder`; where it holds per-rank records only, `rank`'s own.
        The folder is listed once for all of it (data files are never rewritten in place:
        one listing holds for the whole load, which opens each file and checks its size
        again before reading)."""
        listing = folder.sizes()
        try:
            return cls(folder, *read_records(folder, listing=listing), listing=listing)
        except FileNotFoundError:
            if not per_rank_records(folder):
                raise
            records = read_records(folder, rank, listing=listing)
            return cls(folder, *records, RecordNames(rank).manifest, listing)

    def metadata(self) -> Metadata:
        """DCP's `Metadata` of the checkpoint (built from the manifest once, when asked)."""
        if self._metadata is None:
            assert self.manifest is not None
            self.manifest.resolve(self.folder, self._name)
            self._metadata = self.manifest.to_metadata()
        if getattr(self._metadata, "storage_meta", None) is None:  # absent from old pickles
            self._metadata.storage_meta = StorageMeta()
        return self._metadata

    def tensor(self, key: str) -> tuple[tuple[int, ...], torch.dtype] | None:
        """(shape, dtype) of stored tensor `key`; None when it is not a stored tensor."""
        if self.manifest is not None:
            entry = self.manifest.tensors.get(key)
            return None if entry is None else (tuple(entry.shape), dtype_from_name(entry.dtype))
        md = self.metadata().state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            return None
        return tuple(md.size), md.properties.dtype

    def is_object(self, key: str) -> bool:
        if self.manifest is not None:
            return key in self.manifest.objects
        md = self.metadata().state_dict_metadata.get(key)
        return md is not None and not isinstance(md, TensorStorageMetadata)

    def stored_chunks(self, keys: list[str], objects: list[str]) -> Iterator[tuple[str, Covering]]:
        """Each of the stored tensors `keys` as what `covering` a box finds in it: from
        a version 4 index, the sections of these keys only, read in index order; once
        all are taken, the names and byte ranges of every row found and of the stored
        `objects` read with them are checked together (a version 4 manifest was read
        without them: `read_records`)."""
        sections = self.sections(keys, objects)
        yield from sections
        sections.check()

    def sections(self, keys: list[str], objects: list[str], take: Take | None = None) -> Sections:
        """`stored_chunks` as an iterable whose check the caller makes (`Sections.check`),
        once it has found all it reads; `take` is offered each group of sections first
        (`whole_rows`) and gives back those it leaves, which the iteration yields."""
        return Sections(self, keys, objects, take)

    def chunks(self, key: str) -> list[StoredBox]:
        """The stored chunks of tensor `key`: their boxes, and what `storage` turns into
        what reading one needs (only for the chunks a load reads: most it never touches)."""
        if self.manifest is not None:
            return [(c.offsets, c.sizes, c) for c in self.manifest.tensors[key].chunks]
        metadata = self.metadata()
        md = metadata.state_dict_metadata[key]
        assert isinstance(md, TensorStorageMetadata)
        return [
            (tuple(c.offsets), tuple(c.sizes), _storage(metadata, MetadataIndex(key, c.offsets)))
            for c in md.chunks
        ]

    def storage(self, key: str, stored: Any) -> _StorageInfo:
        """DCP's storage info of a chunk of `chunks(key)`, with the manifest's checksums."""
        if isinstance(stored, ChunkEntry):
            assert self.manifest is not None
            dtype = self.manifest.tensors[key].dtype
            return StoredChunk.of(stored, dtype, self.manifest.page_size)
        return stored

    def object_info(self, key: str) -> _StorageInfo:
        if self.manifest is not None:
            o = self.manifest.objects[key]
            return StoredObject(o.file, o.offset, o.length, o.transform, o.crc32c)
        return _storage(self.metadata(), MetadataIndex(key))


def _storage(metadata: Metadata, index: MetadataIndex) -> Any:
    info = (metadata.storage_data or {}).get(index)
    if info is None:  # `check_metadata` refused this already: never, but never unchecked
        raise CorruptCheckpointError(f"'{index.fqn}' (at {index.offset}) has no storage entry")
    return info


class Covering(Protocol):
    @property
    def sectioned(self) -> TensorChunks | None:
        """Its section's rows, to plan many pieces at once (`row_batches`)."""
        ...

    def covering(
        self, offsets: tuple[int, ...], sizes: tuple[int, ...], rows: list[int] | None = None
    ) -> list[StoredBox]:
        """The stored chunks overlapping the non-empty box (`offsets`, `sizes`): the `rows`
        of its section, when the caller found them."""
        ...

    def parts(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> list[StoredBox] | Boxes:
        """The same, or as arrays when they are all small plain chunks (`row_boxes`)."""
        ...


class _Sectioned:
    """A tensor's chunks from its section (`manifest_index.TensorChunks`)."""

    def __init__(self, chunks: TensorChunks) -> None:
        self.chunks = self.sectioned = chunks

    def covering(
        self, offsets: tuple[int, ...], sizes: tuple[int, ...], rows: list[int] | None = None
    ) -> list[StoredBox]:
        return [(c.offsets, c.sizes, c) for c in self.chunks.covering(offsets, sizes, rows)]

    def parts(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> list[StoredBox] | Boxes:
        rows = self.chunks.table.overlapping(offsets, sizes)
        # one row: the piece is that chunk, or inside it: one read either way
        boxes = one_tile_boxes(self.chunks, offsets, sizes, rows) if len(rows) > 1 else None
        return self.covering(offsets, sizes, rows) if boxes is None else boxes


class _Listed:
    """A tensor's chunks as a list, checked when the records were read."""

    sectioned = None

    def __init__(self, chunks: list[StoredBox]) -> None:
        self.chunks = chunks
        # many chunks (a tensor sharded over many ranks): a box read whole is found at once
        self.exact = {(c[0], c[1]): c for c in chunks} if len(chunks) > 8 else None

    def parts(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> list[StoredBox]:
        return self.covering(offsets, sizes)  # checked whole when read: few rows, or old formats

    def covering(
        self, offsets: tuple[int, ...], sizes: tuple[int, ...], rows: list[int] | None = None
    ) -> list[StoredBox]:
        if self.exact is not None:
            same = self.exact.get((offsets, sizes))
            if same is not None:
                return [same]
        return [
            c
            for c in self.chunks
            if all(o < a + n and a < o + m and m for a, n, o, m in zip(offsets, sizes, c[0], c[1]))
        ]


# what a load takes of a group of sections itself (`whole_rows`); it gives back the rest
Take = Callable[[list[Section]], list[Section]]
GROUP_ROWS = 1 << 16  # rows of the sections offered to a `Take` at once
GROUP_SECTIONS = 4096  # and sections


class Sections:
    """The sections of a load's keys (see `StoredView.stored_chunks`), and the check of
    every byte range it found in them (`check`). The byte ranges of its rows go in
    `spans` (arrays) or `ranges` (a dict entry each)."""

    def __init__(self, view: StoredView, keys: list[str], objects: list[str], take: Take | None):
        self.view, self.keys, self.objects, self.take = view, keys, objects, take
        self.ranges: Ranges = {}
        self.spans = RowSpans()
        index = None if view.manifest is None else view.manifest.index
        listing = view._listing  # listed once, when the records were read
        if listing is None:  # no index: no listing needed
            listing = {} if index is None else view.folder.sizes()
        self.listing = listing
        # the checksums writers keep (version 5), fetched from the files of this listing
        self.fetch = None if index is None else fetcher(view.folder, self.listing, index.file)

    def __iter__(self) -> Iterator[tuple[str, Covering]]:
        view, manifest = self.view, self.view.manifest
        if manifest is None or manifest.index is None:
            for key in self.keys:
                yield key, _Listed(view.chunks(key))
            return
        where = view.folder.where(view._name)
        for key in self.objects:
            o = manifest.objects[key]
            check_name(view.folder, key, o.file, where, shardwise=True)
            self.ranges[(key, -1)] = (key, o.file, o.offset, o.length)
        found = section_bytes(
            view.folder, manifest.index, self.keys, manifest.tensors, where, self.listing
        )
        for group in _groups(found, self.take is not None):
            for key, t, data, name in group if self.take is None else self.take(group):
                shape, count = tuple(t.shape), t.section[3]  # type: ignore[index]
                table = ChunkTable(
                    data, len(shape), count, t.transforms, name, manifest.version, self.fetch, shape
                )
                yield key, _Sectioned(TensorChunks(key, t, table, self.ranges, self.spans))

    def check(self) -> None:
        """Every byte range found (once all are: before any is read), see `check_read_ranges`."""
        manifest = self.view.manifest
        if manifest is not None and manifest.index is not None:
            index = manifest.index.file
            check_read_ranges(self.view.folder, self.ranges, self.listing, self.spans, index)


def _groups(found: Iterator[Section], grouped: bool) -> Iterator[list[Section]]:
    """Sections one at a time, or (`grouped`) up to `GROUP_ROWS` rows or `GROUP_SECTIONS`
    sections at a time."""
    group: list[Section] = []
    rows = 0
    for s in found:
        group.append(s)
        rows += s[1].section[3]  # type: ignore[index]
        if not grouped or rows >= GROUP_ROWS or len(group) >= GROUP_SECTIONS:
            yield group
            group, rows = [], 0
    if group:
        yield group
