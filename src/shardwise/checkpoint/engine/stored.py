"""What a checkpoint stores, as every reader sees it: one view of shardwise and
stock records.

`StoredView` answers, for a piece of a load, which stored chunks overlap it
and where their bytes are; pieces that are whole stored chunks are planned as
arrays a group of sections at a time; the rows a piece overlaps have their
checksums fetched in groups.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from ...errors import CorruptCheckpointError
from ...layout import overlap
from ...storage import Folder
from ..format import (
    MANIFEST,
    Boxes,
    ChunkEntry,
    ChunkTable,
    Fetch,
    Manifest,
    Pending,
    Ranges,
    RecordNames,
    Rows,
    RowSpans,
    Slots,
    StoredChunk,
    StoredObject,
    TensorChunks,
    TensorEntry,
    Unsettled,
    check_name,
    check_read_ranges,
    decode,
    dtype_from_name,
    fetchable,
    fetcher,
    file_of,
    one_tile_boxes,
    plain,
    resolve_rows,
    row_columns,
    section_bytes,
    slot_ranges,
)
from ..io import ChunkRead, PendingChunk, per_rank_records
from .inventory import Piece
from .records import read_records

__all__ = [
    "BATCH",
    "Covering",
    "GROUP",
    "Section",
    "Sections",
    "StoredBox",
    "StoredView",
    "WholeRows",
    "fetched",
    "read_records",
]


# -----------------------------------------------------------------------------
# Pieces that are whole stored chunks, planned as arrays a group of sections at a time.
#
# The common load — each piece of a target exactly one stored chunk (a rank loading
# what it saved) — made one `ChunkTable`, one `ChunkEntry`, one `StoredChunk` and
# one `ChunkRead` per piece before reading any, and a dict entry per byte range:
# about 4 KB and 100 µs a piece, 100,000 small tensors costing 200 MiB and 10 s
# a rank. Here the sections of a group are decoded together (`format.table`) and
# each piece checked against its section's rows by numpy passes over the group:
# exactly one row overlaps it and that row's box is the piece's (so it is covered
# exactly once), the row is a plain one-tile chunk in bounds with consistent byte
# ranges (`format.table.plain`), the checksums its writer keeps fetchable and fetched
# with the other rows' (`format.index.Pending`), its byte range added to the load's as
# arrays (`RowSpans`, checked before any read). A section any of whose pieces
# fails any of that is handed back, and planned alone as before (`ChunkTable`,
# `TensorChunks.covering`), which names what is wrong: nothing is accepted here
# that the one-piece path would refuse. What was accepted stays as a few columns a
# piece, turned into read requests `BATCH` pieces at a time, once every range of
# the load is checked (`reads`).
# -----------------------------------------------------------------------------

BATCH = 8192  # pieces whose read requests exist at once

SLOTS = 1 << 16  # checksum slots kept to fetch with other rows' at most

PAIRS = 1 << 16  # (piece, row) pairs compared at once: a few MiB of arrays

# a section as read: its key, its tensor's head, its bytes, its name in errors
Section = tuple[str, TensorEntry, bytes, str]


@dataclass
class _Wholes:
    """Accepted pieces of one group: piece `i` is the whole stored chunk `cols[i]` (rank,
    k, token, record offset and length, payload offset and length, sizes) of tensor
    `keys[which[i]]` (of dtype `dtypes[which[i]]`), its checksum `crc[read[i]]`, read
    into `tensors[i]`."""

    keys: list[str]
    dtypes: list[str]
    which: np.ndarray
    tensors: list[torch.Tensor]
    cols: np.ndarray
    crc: np.ndarray  # of every accepted piece of the group (filled when fetched)
    read: np.ndarray  # which of them are read: piece `i` is `read[i]` of them


class WholeRows:
    """The whole-chunk pieces of a load (`held`: each key's pieces; `sent`: keys checked
    but not read, another rank sends them; `leave`: keys the load plans otherwise, the
    read-once exchange's), taken group by group (`take`)."""

    def __init__(
        self,
        held: dict[str, list[Piece]],
        sent: set[str],
        version: int,
        spans: RowSpans,
        fetch: Fetch,
        leave: frozenset[str] | set[str] = frozenset(),
    ) -> None:
        self.held, self.sent, self.version = held, sent, version
        self.leave = leave
        self.spans, self.fetch = spans, fetch  # `fetch`: the checksums writers keep
        self.wholes: list[_Wholes] = []
        self.pending: list[Pending] = []  # checksums their writers keep, to fetch
        self.slots = 0  # in `pending`
        self.taken = 0  # pieces accepted

    def take(self, group: list[Section]) -> list[Section]:
        """Accept what it can of `group`; the sections it leaves."""
        rest: list[Section] = []
        by_ndim: dict[int, list[Section]] = {}
        for s in group:
            ndim = len(s[1].shape)
            (by_ndim.setdefault(ndim, []) if ndim and s[0] not in self.leave else rest).append(s)
        for ndim, part in by_ndim.items():
            batch: list[Section] = []
            pairs = 0  # (piece, row) pairs `_take` compares: at most `PAIRS` at once
            for s in part:
                n = len(self.held[s[0]]) * s[1].section[3]  # type: ignore[index]
                if n > PAIRS:  # many pieces of many rows: planned alone, row by row
                    rest.append(s)
                    continue
                if pairs + n > PAIRS:
                    rest += self._take(batch, ndim)
                    batch, pairs = [], 0
                batch.append(s)
                pairs += n
            if batch:
                rest += self._take(batch, ndim)
        return rest

    def _take(self, part: list[Section], d: int) -> list[Section]:
        assert all(t.section is not None for _k, t, _b, _n in part)
        rows = decode([(data, t.section[3]) for _k, t, data, _n in part], d, self.version)  # type: ignore[index]
        if not len(rows.columns):  # no row: nothing to take
            return part
        offsets, sizes, tensors, of = [], [], [], []
        mismatched = np.zeros(len(part), dtype=bool)  # a piece to cast: planned alone
        for s, (key, t, _data, _name) in enumerate(part):
            dtype = dtype_from_name(t.dtype)
            for p in self.held[key]:
                mismatched[s] |= p.tensor.dtype != dtype
                offsets.append(p.offsets)
                sizes.append(p.sizes)
                tensors.append(p.tensor)
                of.append(s)
        sec = np.asarray(of, dtype=np.int64)
        lo = np.asarray(offsets, dtype=np.int64).reshape(-1, d)
        n = np.asarray(sizes, dtype=np.int64).reshape(-1, d)
        row = _row_of(rows, sec, lo, n, d)
        r = np.maximum(row, 0)
        shapes = np.asarray([t.shape for _k, t, _b, _n in part], dtype=np.int64).reshape(-1, d)
        items = np.asarray([dtype_from_name(t.dtype).itemsize for _k, t, _b, _n in part])
        c = rows.columns
        good = (row >= 0) & plain(c[r], shapes[sec], items[sec])
        kept = np.flatnonzero(good & (rows.crc_at[r] >= 0))
        fits = np.zeros(len(kept), dtype=bool)
        fits[fetchable(c[r[kept]], d, shapes[sec[kept]])] = True
        good[kept[~fits]] = False
        refused = ~rows.ok | mismatched | (np.bincount(sec, weights=~good, minlength=len(part)) > 0)
        taken = ~refused[sec]
        if taken.any():
            self._keep(
                part,
                rows,
                sec[taken],
                r[taken],
                n[taken],
                [tensors[i] for i in np.flatnonzero(taken).tolist()],
                d,
            )
        for s in np.flatnonzero(~refused).tolist():  # its pieces are kept here now
            del self.held[part[s][0]]
        return [part[s] for s in np.flatnonzero(refused).tolist()]

    def _keep(
        self,
        part: list[Section],
        rows: Rows,
        sec: np.ndarray,
        r: np.ndarray,
        n: np.ndarray,
        tensors: list[torch.Tensor],
        d: int,
    ) -> None:
        """The accepted pieces: checksums their writers keep to fetch (each row once),
        byte ranges added to the load's, the rest kept to read."""
        c, col = rows.columns, row_columns(d)
        file = slice(col.rank, col.token + 1)  # rank k token: the data file's name
        crc = rows.first[r]
        kept = np.flatnonzero(rows.crc_at[r] >= 0)
        if len(kept):
            wanted, back = np.unique(r[kept], return_inverse=True)
            slots = Slots(
                c[wanted, file],
                rows.crc_at[wanted],
                c[wanted, col.crc_count],
                rows.sec[wanted],
                [name for _k, _t, _b, name in part],
            )
            self.pending.append(Pending(slots, _filler(crc, kept, back)))
            self.slots += len(wanted)
            if self.slots >= SLOTS:  # fetched now, not kept until the next group of rows
                resolve_rows([], self.fetching(), self.fetch)
        keys = [key for key, _t, _b, _n in part]
        self.spans.add_many(keys, sec, r - rows.start[sec], c[r, col.rank : col.record.stop])
        self.taken += len(sec)
        read = np.flatnonzero(~np.asarray([key in self.sent for key in keys], dtype=bool)[sec])
        if len(read):
            cols = np.hstack([c[r[read], col.stored], n[read]])
            picked = [tensors[i] for i in read.tolist()]
            dtypes = [t.dtype for _k, t, _b, _n in part]
            self.wholes.append(_Wholes(keys, dtypes, sec[read], picked, cols, crc, read))

    def fetching(self) -> list[Pending]:
        """The checksum slots of the rows taken since last asked, to fetch with the rows
        found one at a time (`engine.stored.fetched`): one read per data file and group."""
        pending, self.pending, self.slots = self.pending, [], 0
        return pending

    def reads(self, page_size: int) -> Iterator[list[ChunkRead]]:
        """The accepted pieces' read requests, `BATCH` at a time (once every byte range
        of the load is checked); the columns of each group dropped once it is made."""
        files: dict[tuple[int, int, int], str] = {}
        while self.wholes:
            w = self.wholes.pop(0)
            for lo in range(0, len(w.which), BATCH):
                yield _requests(w, lo, lo + BATCH, page_size, files)


def _filler(
    crc: np.ndarray, kept: np.ndarray, back: np.ndarray
) -> Callable[[np.ndarray, np.ndarray], None]:
    def fill(_frame: np.ndarray, first: np.ndarray) -> None:
        crc[kept] = first[back]  # one checksum each: the first is all of them

    return fill


def _row_of(rows: Rows, sec: np.ndarray, lo: np.ndarray, n: np.ndarray, d: int) -> np.ndarray:
    """Each piece's row: the one row of its section overlapping it, when that row's box
    is the piece's; -1 when none, or when others overlap it too."""
    per = rows.count[sec]
    pair = np.repeat(np.arange(len(sec)), per)
    row = rows.start[sec][pair] + np.arange(len(pair)) - (np.cumsum(per) - per)[pair]
    col = row_columns(d)
    at, size = rows.columns[row, col.offsets], rows.columns[row, col.sizes]
    plo, pn = lo[pair], n[pair]
    hit = ((at < plo + pn) & (at + size > plo) & (size > 0)).all(axis=1)
    same = hit & (at == plo).all(axis=1) & (size == pn).all(axis=1)
    out = np.full(len(sec), -1, dtype=np.int64)
    out[pair[same]] = row[same]
    out[np.bincount(pair[hit], minlength=len(sec)) != 1] = -1
    return out


def _requests(
    w: _Wholes, lo: int, hi: int, page_size: int, files: dict[tuple[int, int, int], str]
) -> list[ChunkRead]:
    out = []
    zero = (0,) * (w.cols.shape[1] - 7)  # one for all: every box starts at its chunk's start
    cols, which = w.cols[lo:hi].tolist(), w.which[lo:hi].tolist()
    crcs = w.crc[w.read[lo:hi]].tolist()
    for i, (row, kid, crc) in enumerate(zip(cols, which, crcs)):
        rank, k, token, rec_off, rec_len, pay_off, pay_len = row[:7]
        sizes = tuple(row[7:])
        name = files.get((rank, k, token))
        if name is None:
            name = files[(rank, k, token)] = file_of(rank, k, token)
        dtype = w.dtypes[kid]
        info = StoredChunk(
            name, rec_off, rec_len, None, dtype, sizes, (pay_off, pay_len), [crc], page_size, sizes
        )
        target = w.tensors[lo + i].detach()
        out.append(ChunkRead(w.keys[kid], info, sizes, dtype_from_name(dtype), zero, sizes, target))
    return out


# -----------------------------------------------------------------------------
# What a checkpoint stores, as every reader sees it: one view of shardwise and stock records.
#
# `StoredView.read` finds a checkpoint's records once — `shardwise.json` (never
# unpickling `.metadata`), or a stock `.metadata` through an unpickler that admits
# only DCP's classes (also when stock `dcp.save` replaced a shardwise checkpoint in
# place), or a rank's own records (`use_collectives=False`) — and answers, per key,
# what a load needs: a tensor's shape, dtype and stored chunks (with their storage
# info: checksums and payload offsets for shardwise chunks, none for stock ones), or
# an object's storage info. The load engine plans from it; `Reader.read_metadata`
# is its `metadata()`. Built per key on demand: a load of a few keys of a large
# manifest builds nothing for the rest.
# -----------------------------------------------------------------------------


class StoredBox(NamedTuple):
    """A stored chunk's box, and the chunk: its manifest entry, or DCP's storage info
    (`StoredView.storage` turns either into what reading it needs)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    stored: Any


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

    @property
    def per_rank(self) -> bool:
        """Whether this view is one rank's own records (a checkpoint of per-rank records
        only): other ranks see other records."""
        return self._name != MANIFEST

    @property
    def listing(self) -> dict[str, int] | None:
        """The folder's files and sizes, listed when the records were read (None: not)."""
        return self._listing

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
        `format.pickles` read with them are checked together (a version 4 manifest was read
        without them: `read_records`)."""
        sections = self.sections(keys, objects)
        yield from sections
        sections.check()

    def sections(self, keys: list[str], objects: list[str], take: Take | None = None) -> Sections:
        """`stored_chunks` as an iterable whose check the caller makes (`Sections.check`),
        once it has found all it reads; `take` is offered each group of sections first
        (`engine.stored`) and gives back those it leaves, which the iteration yields."""
        return Sections(self, keys, objects, take)

    def chunks(self, key: str) -> list[StoredBox]:
        """The stored chunks of tensor `key`: their boxes, and what `storage` turns into
        what reading one needs (only for the chunks a load reads: most it never touches)."""
        if self.manifest is not None:
            return [StoredBox(c.offsets, c.sizes, c) for c in self.manifest.tensors[key].chunks]
        metadata = self.metadata()
        md = metadata.state_dict_metadata[key]
        assert isinstance(md, TensorStorageMetadata)
        return [
            StoredBox(
                tuple(c.offsets), tuple(c.sizes), _storage(metadata, MetadataIndex(key, c.offsets))
            )
            for c in md.chunks
        ]

    def storage(self, key: str, stored: Any) -> _StorageInfo:
        """DCP's storage info of a chunk of `chunks(key)`, with the manifest's checksums
        (those its writer keeps, when not fetched yet: fetched as it is read)."""
        if isinstance(stored, Unsettled):
            assert self.manifest is not None
            dtype = self.manifest.tensors[key].dtype
            return PendingChunk.planned(stored, dtype, self.manifest.page_size)
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
        """Its section's rows, to plan many pieces at once (`format.table`)."""
        ...

    def covering(
        self,
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
        rows: list[int] | None = None,
        fetch: bool = True,
    ) -> list[StoredBox]:
        """The stored chunks overlapping the non-empty box (`offsets`, `sizes`): the `rows`
        of its section, when the caller found them. `fetch=False`: checksums their
        writers keep are fetched only when the chunk is read (`format.index.Unsettled`)."""
        ...

    def parts(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> list[StoredBox] | Boxes:
        """The same, or as arrays when they are all small plain chunks (`format.table`)."""
        ...


class _Sectioned:
    """A tensor's chunks from its section (`format.index.TensorChunks`)."""

    def __init__(self, chunks: TensorChunks) -> None:
        self.chunks = self.sectioned = chunks

    def covering(
        self,
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
        rows: list[int] | None = None,
        fetch: bool = True,
    ) -> list[StoredBox]:
        if rows is None:
            rows = self.chunks.table.overlapping(offsets, sizes)
        found = self.chunks.covering(offsets, sizes, rows, fetch)
        return [
            StoredBox(c.offsets, c.sizes, c if c.crc_at < 0 else self.chunks.unsettled(i, c))
            for i, c in zip(rows, found)
        ]

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
        self.exact = {(c.offsets, c.sizes): c for c in chunks} if len(chunks) > 8 else None

    def parts(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> list[StoredBox]:
        return self.covering(offsets, sizes)  # checked whole when read: few rows, or old formats

    def covering(
        self,
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
        rows: list[int] | None = None,
        fetch: bool = True,
    ) -> list[StoredBox]:
        if self.exact is not None:
            same = self.exact.get((offsets, sizes))
            if same is not None:
                return [same]
        return [c for c in self.chunks if overlap(offsets, sizes, c.offsets, c.sizes) is not None]


# what a load takes of a group of sections itself (`engine.stored`); it gives back the rest
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


# -----------------------------------------------------------------------------
# The stored rows each piece of a load overlaps, their checksums fetched in groups.
#
# From format version 5 a collective save's writers keep each chunk's checksums in
# their own data files (`format.index`). A load needs those of the rows
# it reads, and fetching them row by row would cost one read per row (1,000 per
# rank, each a request on an object store); fetched for many sections at once,
# they cost one read per data file and group.
# -----------------------------------------------------------------------------

# sections whose rows' checksums are fetched together: up to this many rows in all
# (their tables held at once: 8 MiB of FSDP sections at 1,024 ranks)
GROUP = 1 << 16


def fetched(
    sections: Iterator[tuple[str, Covering]],
    held: dict[str, list[Piece]],
    whole: WholeRows | None = None,
    later: frozenset[str] | set[str] = frozenset(),
) -> Iterator[tuple[str, Covering, list[list[int] | None]]]:
    """Each section with the rows each of its pieces overlaps (None: not sectioned),
    sections of up to `GROUP` rows at a time, the checksums of those rows that their
    writers keep fetched for the group at once (`format.index`), with those of the
    rows `whole` took since: a read per data file and group, not one a row. Keys in
    `later` fetch none: their chunks are planned without them (`Covering.covering`'s
    `fetch=False`), the rank that reads each fetching them with its bytes."""
    group: list[tuple[str, Covering, list[list[int] | None]]] = []
    rows = 0
    for key, stored in sections:
        table = None if stored.sectioned is None else stored.sectioned.table
        group.append((key, stored, [_rows(table, p) for p in held[key]]))
        rows += 0 if table is None else len(table)
        if rows >= GROUP:
            yield from _fetch(group, whole, later)
            group, rows = [], 0
    yield from _fetch(group, whole, later)


def _rows(table: ChunkTable | None, piece: Piece) -> list[int] | None:
    return None if table is None else table.overlapping(piece.offsets, piece.sizes)


def _fetch(
    group: list[tuple[str, Covering, list[list[int] | None]]],
    whole: WholeRows | None,
    later: frozenset[str] | set[str],
) -> list[tuple[str, Covering, list[list[int] | None]]]:
    # rows fetched now; rows whose reader fetches them
    tables: list[tuple[ChunkTable, list[int]]] = []
    unread: list[tuple[ChunkTable, list[int]]] = []
    for key, stored, found in group:
        for r in found:
            if r:
                (unread if key in later else tables).append((stored.sectioned.table, r))  # type: ignore[union-attr]
    # where their checksums lie is checked here on every rank as if fetched (inside a
    # plain data file, none overlapping another's, the group's fetched rows' included),
    # whether or not checksums are verified
    if unread:
        slot_ranges([*unread, *tables])
    if whole is None:
        resolve_rows(tables)
    else:
        resolve_rows(tables, whole.fetching(), whole.fetch)
    return group
