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
from .chunk_table import ChunkTable
from .manifest_entries import VERSION, ChunkEntry, IndexRef, TensorEntry, dtype_from_name
from .read_ranges import Ranges, RowSpans, check_read_ranges
from .record_check import check_coverage, chunk_consistent
from .section_encode import encode_section
from .section_reads import WINDOW, section_bytes
from .writer_checksums import fetcher, resolve_rows

__all__ = [
    "Ranges",
    "RowSpans",
    "TensorChunks",
    "WINDOW",
    "check_read_ranges",
    "read_sections",
    "resolve_sections",
    "section_bytes",
    "write_sections",
]


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
    listing = folder.sizes() if listing is None else listing
    fetch = fetcher(folder, listing, index.file)
    keys, heads = [key for key, _t in tensors], dict(tensors)
    for key, t, data, name in section_bytes(folder, index, keys, heads, source, listing):
        assert t.section is not None
        shape = tuple(t.shape)
        yield (
            key,
            ChunkTable(data, len(shape), t.section[3], t.transforms, name, version, fetch, shape),
        )


def resolve_sections(
    folder: Folder, index: IndexRef, tensors: dict[str, TensorEntry], source: str, version: int
) -> None:
    """Every tensor's chunk entries, from its section (for tools: `Manifest.read`): the
    checksums their writers keep fetched for all sections at once."""
    tables = list(read_sections(folder, index, list(tensors.items()), source, version=version))
    resolve_rows([(table, range(len(table))) for _key, table in tables])
    for key, table in tables:
        tensors[key].chunks = table.entries()


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
