"""The index of a version 4 checkpoint: its tensors' chunk sections, written and read.

A save writes every tensor's section (`chunk_table`) into one data file of its
own, the index, block by block (one block per writer of sections: each owner of
keys in a collective save, `io.record_join`), and the manifest points at each
section. Readers take what they need from it:

- a load (`StoredView`) reads the sections of the tensors it loads, in windows
  of adjacent sections (one read per window, never the whole index at once), and
  decodes only the rows that overlap its pieces (`TensorChunks`): for each piece
  the rows it reads are checked as a manifest's chunks are — in bounds,
  consistent sizes and checksums, covering the piece exactly once — and the byte
  ranges of all the rows it reads lie inside their data files, no two
  overlapping (`check_read_ranges`);
- tools (`Manifest.read`) resolve every section into the entries a version 3
  manifest lists, then check them all together.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Sequence

import crc32c
import numpy as np

from ...errors import CorruptCheckpointError
from ...storage import Folder
from .chunk_table import ChunkTable, file_of
from .manifest_entries import VERSION, ChunkEntry, IndexRef, TensorEntry, dtype_from_name
from .record_check import DATA_FILE, check_coverage, check_name, check_ranges, chunk_consistent
from .section_encode import encode_section
from .writer_checksums import fetcher, resolve_rows

__all__ = [
    "Ranges",
    "RowSpans",
    "TensorChunks",
    "check_read_ranges",
    "read_sections",
    "resolve_sections",
    "write_sections",
]

WINDOW = 8 << 20  # bytes of adjacent sections read at once


def write_sections(tensors: dict[str, TensorEntry], block: int) -> bytes:
    """The sections of `tensors` as block `block` of an index: each tensor's `section`
    and `transforms` set to point into it."""
    out, at = [], 0
    for t in tensors.values():
        t.transforms = []
        data = encode_section(t.chunks, len(t.shape), t.transforms)
        t.section = (block, at, len(data), len(t.chunks), crc32c.crc32c(data))
        out.append(data)
        at += len(data)
    return b"".join(out)


def read_sections(
    folder: Folder,
    index: IndexRef,
    tensors: Sequence[tuple[str, TensorEntry]],
    source: str,
    listing: dict[str, int] | None = None,
    version: int = VERSION,
) -> Iterator[tuple[str, ChunkTable]]:
    """Each of `tensors`' chunk tables, checked, in index order: adjacent sections read
    together, a window of at most `WINDOW` bytes (or one section) at a time. `listing`:
    the folder's plain files and sizes, when the caller has listed it already;
    `version`: the manifest's (5: rows may keep their checksums in data files)."""
    check_name(folder, "index", index.file, source, shardwise=True)
    where = folder.where(index.file)
    spans = []
    for key, t in tensors:
        assert t.section is not None
        block, offset, length, count, crc = t.section
        if block >= len(index.blocks):
            raise CorruptCheckpointError(f"{source}: '{key}' names block {block} of its index")
        spans.append((index.blocks[block] + offset, length, count, crc, key, t))
    spans.sort(key=operator.itemgetter(0))
    listing = folder.sizes() if listing is None else listing
    size = listing.get(index.file)  # plain files only: never a link or a folder
    if size is None:
        raise CorruptCheckpointError(
            f"{source}: index file {where} is missing or not a plain file "
            "(links and folders are refused)"
        )
    fetch = fetcher(folder, listing, index.file)
    file = folder.open(index.file)
    try:
        i = 0
        while i < len(spans):
            start = spans[i][0]
            j = i + 1
            while j < len(spans) and spans[j][0] + spans[j][1] - start <= WINDOW:
                j += 1
            end = max(s[0] + s[1] for s in spans[i:j])
            if end > size:
                raise CorruptCheckpointError(
                    f"{source}: sections up to byte {end} of {where} ({size} bytes): truncated"
                )
            window = file.pread(end - start, start)
            for at, length, count, crc, key, t in spans[i:j]:
                data = window[at - start : at - start + length]
                if crc32c.crc32c(data) != crc:
                    raise CorruptCheckpointError(
                        f"{where}: the section of '{key}' does not match its checksum (damaged)"
                    )
                name, shape = f"{where} '{key}'", tuple(t.shape)
                table = ChunkTable(
                    data, len(shape), count, t.transforms, name, version, fetch, shape
                )
                yield key, table
            i = j
    finally:
        file.close()


def resolve_sections(
    folder: Folder, index: IndexRef, tensors: dict[str, TensorEntry], source: str, version: int
) -> None:
    """Every tensor's chunk entries, from its section (for tools: `Manifest.read`): the
    checksums their writers keep fetched for all sections at once."""
    tables = list(read_sections(folder, index, list(tensors.items()), source, version=version))
    resolve_rows([(table, range(len(table))) for _key, table in tables])
    for key, table in tables:
        tensors[key].chunks = table.entries()


# what a load reads, by tensor key and row (an object: row -1), as (key, file, offset, length)
Ranges = dict[tuple[str, int], tuple[str, str, int, int]]


class RowSpans:
    """The byte ranges of rows a load found as arrays (`row_boxes`), by tensor: one
    array of (key id, row, rank, k, token, offset, length) per piece."""

    def __init__(self) -> None:
        self.keys: dict[str, int] = {}
        self.parts: list[np.ndarray] = []

    def add(self, key: str, rows: np.ndarray, where: np.ndarray) -> None:
        """Rows `rows` of `key`'s section, `where` they are: (rank, k, token, offset, length)."""
        kid = self.keys.setdefault(key, len(self.keys))
        ids = np.full(len(rows), kid, dtype=np.int64)
        self.parts.append(np.column_stack([ids, rows, where]))


def check_read_ranges(
    folder: Folder,
    ranges: Ranges,
    sizes: dict[str, int],
    spans: RowSpans | None = None,
    index: str | None = None,
) -> None:
    """The byte ranges of every row and object a load reads (`TensorChunks.ranges`, and
    `spans` as arrays), once all are known and before any is read: inside their data
    files, none in the `index` file (its name is a data file's), no two overlapping —
    two rows naming the same bytes included (one row found by several pieces is one
    entry)."""
    if index is not None:
        _refuse_index(folder, index, ranges, spans)
    if spans is None or not spans.parts:
        check_ranges(folder, sorted(ranges.values()), sizes)
        return
    listed = _listed(ranges, spans)
    if listed is None:  # something is wrong: the plain check names it
        check_ranges(folder, sorted(_every(ranges, spans)), sizes)
        return
    files, ids, offset, length = listed
    size = np.asarray([sizes.get(name, -1) for name in files], dtype=np.int64)[ids]
    end = offset + length
    order = np.lexsort((offset, ids))
    nonzero = order[length[order] > 0]
    same = ids[nonzero][1:] == ids[nonzero][:-1]
    if (
        (size < 0).any()
        or (end > size).any()
        or (offset[nonzero][1:] < end[nonzero][:-1])[same].any()
    ):
        check_ranges(folder, sorted(_every(ranges, spans)), sizes)


def _refuse_index(folder: Folder, index: str, ranges: Ranges, spans: RowSpans | None) -> None:
    key = next((k for k, name, _at, _n in ranges.values() if name == index), None)
    named = DATA_FILE.fullmatch(index)
    if key is None and named is not None and spans is not None and spans.parts:
        triple = (int(named.group(1)), int(named.group(2)), int(named.group(3), 16))
        found = np.concatenate(spans.parts)
        hit = np.flatnonzero((found[:, 2:5] == triple).all(axis=1))
        if len(hit):
            key = list(spans.keys)[int(found[hit[0], 0])]
    if key is not None:
        raise CorruptCheckpointError(
            f"'{key}': its stored bytes would be read from the index file {folder.where(index)}: "
            "damaged or crafted records"
        )


def _listed(
    ranges: Ranges, spans: RowSpans
) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray] | None:
    """Every range once, as (file names, file id, offset, length) arrays; None when one
    row has two descriptions (never from one section: `_every` lists them)."""
    found = np.concatenate(spans.parts)  # key id, row, rank, k, token, offset, length
    found = found[np.lexsort(found.T[::-1])]
    same = (found[1:, :2] == found[:-1, :2]).all(axis=1)
    if (found[1:][same] != found[:-1][same]).any():
        return None
    found = found[np.append(True, ~same)]
    both = [(spans.keys[k], row) for k, row in ranges if k in spans.keys]
    if both:  # rows also found one at a time: listed there
        taken = np.asarray([kid << 40 | row for kid, row in both], dtype=np.int64)
        found = found[~np.isin(found[:, 0] << 40 | found[:, 1], taken)]
    files = found[:, 2:5]
    order = np.lexsort(files.T[::-1])
    new = np.ones(len(found), dtype=bool)
    new[1:] = (files[order][1:] != files[order][:-1]).any(axis=1)
    ids = np.empty(len(found), dtype=np.int64)
    ids[order] = np.cumsum(new) - 1
    names = [file_of(*t) for t in files[order][new].tolist()]
    index = {name: i for i, name in enumerate(names)}
    extra = [(index.setdefault(name, len(index)), at, n) for _k, name, at, n in ranges.values()]
    more = np.asarray(extra, dtype=np.int64).reshape(-1, 3)
    return (
        list(index),
        np.concatenate([ids, more[:, 0]]),
        np.concatenate([found[:, 5], more[:, 1]]),
        np.concatenate([found[:, 6], more[:, 2]]),
    )


def _every(ranges: Ranges, spans: RowSpans) -> list[tuple[str, str, int, int]]:
    """Every range as `check_ranges` takes them (a row found twice listed once)."""
    keys = list(spans.keys)
    out = dict(ranges)
    for part in spans.parts:
        for kid, row, rank, k, token, at, n in part.tolist():
            out.setdefault((keys[kid], row), (keys[kid], file_of(rank, k, token), at, n))
    return list(out.values())


class TensorChunks:
    """One tensor's stored chunks as a load reads them from its section: the entries
    overlapping each piece, checked (see the module's docstring)."""

    def __init__(
        self,
        key: str,
        entry: TensorEntry,
        table: ChunkTable,
        ranges: Ranges,
        spans: RowSpans | None = None,
    ) -> None:
        self.key, self.entry, self.table = key, entry, table
        self.ranges = ranges  # every byte range the load reads: `check_read_ranges`
        self.spans = spans  # the same, of rows found as arrays (None: none are)
        self.itemsize = dtype_from_name(entry.dtype).itemsize
        self.plain: np.ndarray | None = None  # which rows are plain one-tile chunks, once

    def covering(
        self, offsets: tuple[int, ...], sizes: tuple[int, ...], rows: list[int] | None = None
    ) -> list[ChunkEntry]:
        """The stored chunks overlapping the non-empty box (`offsets`, `sizes`): `rows`,
        when the caller found them (`ChunkTable.overlapping`)."""
        shape, where = self.entry.shape, self.table.where
        if rows is None:
            rows = self.table.overlapping(offsets, sizes)
        found = [self.table.entry(i) for i in rows]
        for c in found:
            if not (
                all(map(operator.le, map(operator.add, c.offsets, c.sizes), shape))
                and chunk_consistent(c, self.itemsize, 4, 0)
            ):
                raise CorruptCheckpointError(
                    f"{where}: chunk at offsets {c.offsets} has inconsistent sizes or byte "
                    f"ranges (file {c.file}, payload {c.payload})"
                )
        self.ranges.update(
            {(self.key, i): (self.key, c.file, *c.record) for i, c in zip(rows, found)}
        )
        clipped = []
        for c in found:
            lo = [max(a, b) for a, b in zip(offsets, c.offsets)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, sizes, c.offsets, c.sizes)]
            clipped.append(
                (tuple(x - a for x, a in zip(lo, offsets)), tuple(h - x for x, h in zip(lo, hi)))
            )
        if math.prod(sizes):
            check_coverage(f"{self.key} (at {offsets})", sizes, clipped, where, replicas=False)
        return found
