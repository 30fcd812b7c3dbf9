"""The chunk table: a tensor's stored chunks as rows of integers, the one home of
the chunk-row columns.

A tensor's chunks are one binary section of the index (format versions 4, 5):
encoded here, decoded many sections at a time, checked with numpy before any
row is trusted, and queried (the parts of a piece in small stored chunks, one
tile's boxes for every piece of a load at once, the byte ranges a load reads,
window by window). Code elsewhere reads rows through the column names defined
here (`ChunkTable`'s columns), never by offset arithmetic of its own.
"""

from __future__ import annotations

import functools
import itertools
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ...errors import CorruptCheckpointError
from ...layout import overlap
from .checks import DATA_FILE, check_coverage
from .checksums import MERGE_GAP, tile_count, valid_tile
from .entries import VERSION, ChunkEntry

if TYPE_CHECKING:
    from .index import TensorChunks

__all__ = [
    "Columns",
    "row_columns",
    "Boxes",
    "ChunkTable",
    "Kept",
    "Rows",
    "Slots",
    "TOKEN",
    "batch_boxes",
    "decode",
    "dense",
    "encode_section",
    "fetchable",
    "file_of",
    "one_tile_boxes",
    "plain",
    "plain_rows",
    "row_strides",
    "row_width",
    "written_count",
]


# -----------------------------------------------------------------------------
# The checksums a section's rows keep in their writers' data files (format version 5),
# as arrays: which rows can be fetched, and what was fetched.
#
# A column rank of a reshard takes a band of every chunk of every tensor: 32,000
# rows at 32 ranks × 1,000 tensors. Row by row in Python their checksums cost more
# than the load's reads; as arrays they cost a few numpy passes (`format.index`
# reads them, `format.table.ChunkTable` keeps them here).
# -----------------------------------------------------------------------------

TOKEN = (1 << 48) - 1


@dataclass
class Slots:
    """Checksum slots to fetch, one per row: its data file (rank, k, token), where its
    slot starts, how many checksums follow its frame, and its table (`names`, for errors)."""

    files: np.ndarray  # (n, 3) int64
    at: np.ndarray
    count: np.ndarray
    table: np.ndarray  # index into `names`
    names: list[str]


class Kept:
    """What was fetched for a table's rows: each row's frame (-1: not fetched), first
    checksum, and all of them for rows with more than one (multi-tile chunks: views
    of what was read, never more than its bytes)."""

    def __init__(self, rows: int) -> None:
        self.frame = np.full(rows, -1, dtype=np.int64)
        self.first = np.zeros(rows, dtype=np.uint32)
        self.many: dict[int, np.ndarray] = {}

    def fill(self, rows: np.ndarray, frame: np.ndarray, first: np.ndarray) -> None:
        self.frame[rows] = frame
        self.first[rows] = first

    def of(self, i: int) -> tuple[int, list[int]]:
        """Row `i`'s (frame, checksums); (0, []) when it was never fetched."""
        if self.frame[i] < 0:
            return 0, []
        many = self.many.get(i)
        return int(self.frame[i]), [int(self.first[i])] if many is None else many.tolist()


def fetchable(cols: np.ndarray, ndim: int, shapes: np.ndarray) -> np.ndarray:
    """Of rows whose writers keep their checksums (`cols`: their version 4 columns,
    `shapes`: each one's tensor's shape), the positions of those that name a data
    file, lie inside their tensor and whose count fits their tile grid (one per tile;
    one for a transformed chunk): a count is never trusted past its tensor's size.
    The others are never fetched: their entries fail the chunk checks."""
    col = row_columns(ndim)
    offsets, sizes, tile = cols[:, col.offsets], cols[:, col.sizes], cols[:, col.tile]
    rank, k, token = cols[:, col.rank], cols[:, col.k], cols[:, col.token]
    count, transform = cols[:, col.crc_count], cols[:, col.transform]
    inside = (sizes <= shapes).all(axis=1) & (offsets <= shapes - sizes).all(axis=1)
    transformed, tiled = transform >= 0, ~(tile == -1).any(axis=1)
    fits = np.where(transformed, count == 1, tiled & (tile == sizes).all(axis=1) & (count == 1))
    for j in np.flatnonzero(~fits & ~transformed & tiled & inside).tolist():  # multi-tile: few
        s, t = tuple(sizes[j].tolist()), tuple(tile[j].tolist())
        fits[j] = valid_tile(s, t) and int(count[j]) == tile_count(s, t)
    named = (rank >= 0) & (k >= 0) & (token <= TOKEN)
    return np.flatnonzero(fits & named & inside)


def written_count(c: ChunkEntry) -> int:
    """How many checksums the writer of `c` keeps for it: one per tile of its grid, or
    one of the whole record when it is transformed."""
    return 1 if c.tile is None else tile_count(c.sizes, c.tile)


# -----------------------------------------------------------------------------
# A tensor's stored chunks as one binary section of the index (format versions 4, 5).
#
# From version 4 the manifest lists each tensor's dtype and shape but not its
# chunks: they are rows of fixed-width integers in a section of the index file.
# A loading rank reads only the sections of the tensors it loads and keeps only
# the rows that overlap what it loads (one vectorised comparison per piece): its
# planning depends on what it loads, not on every chunk of every rank (1,024
# ranks × 1,000 tensors: a million chunks).
#
# A section, little-endian: `count` rows of `3 * ndim + 11` int64 columns (10 up
# to version 4, without `crc_at`), then the checksums of the rows that hold theirs
# (`crc_at` -1), in row order, as uint32:
#
#     offsets[ndim] sizes[ndim] tile[ndim] rank k token record_offset record_length
#     payload_offset payload_length frame crc_count transform crc_at
#
# `rank`, `k` and `token` (48 bits) name the data file `__{rank}_{k}.sw{token}.distcp`,
# so no name in a section can leave the folder; a transformed chunk has `-1` for its
# tile and payload, and its transform is an index into the tensor's `transforms`.
# From version 5 a row's frame and checksums may stay with its writer: `crc_at` is
# where its data file holds them (`1 + crc_count` uint32, the frame first) and its
# `frame` column is 0. A collective save writes them so: its rows are then known
# from the plan alone, and a repeated save exchanges no checksums
# (`format.index`, which fetches them for the rows a reader takes).
# -----------------------------------------------------------------------------

_LIMIT = 1 << 62  # no stored integer reaches it: sums of two stay in int64

_FEW = 16  # rows up to which a section is decoded to lists

_U32 = next(code for code in "IL" if array(code).itemsize == 4)


def row_width(ndim: int, version: int = VERSION) -> int:
    return 3 * ndim + (11 if version >= 5 else 10)


class Columns(NamedTuple):
    """Where each field of a chunk row of one ndim lies (the row above), by name: the
    one home of the chunk-row columns. Every reader of rows, here and beyond
    (`engine.stored`, `format.index`), takes its columns from `row_columns`, so a
    per-chunk field is a column here, a field in `format.entries` and its value in
    `engine.plan`'s records."""

    offsets: slice
    sizes: slice
    box: slice  # offsets, then sizes
    tile: slice
    rank: int
    k: int
    token: int
    record: slice  # the archive's offset and length (the on-disk name of the field)
    payload: slice  # offset, length
    stored: slice  # rank .. payload length: where a row's bytes lie
    frame: int
    crc_count: int  # checksums counted (in the section unless kept by the writer)
    transform: int
    crc_at: int  # from version 5; the width of a version 4 row


def _range(columns: slice) -> list[int]:
    return list(range(columns.start, columns.stop))


@functools.cache
def row_columns(ndim: int) -> Columns:
    d, c = ndim, 3 * ndim
    return Columns(
        offsets=slice(0, d),
        sizes=slice(d, 2 * d),
        box=slice(0, 2 * d),
        tile=slice(2 * d, c),
        rank=c,
        k=c + 1,
        token=c + 2,
        record=slice(c + 3, c + 5),
        payload=slice(c + 5, c + 7),
        stored=slice(c, c + 7),
        frame=c + 7,
        crc_count=c + 8,
        transform=c + 9,
        crc_at=c + 10,
    )


def file_of(rank: int, k: int, token: int) -> str:
    return f"__{rank}_{k}.sw{token:012x}.distcp"


# Fetches slots: each one's frame and first checksum, all of those holding more, by position
Fetch = Callable[[Slots], tuple[np.ndarray, np.ndarray, dict[int, np.ndarray]]]


class ChunkTable:
    """One tensor's section, decoded and checked as a table: which rows overlap a box,
    and the entries of the rows a reader asks for. A few rows are plain lists, the rest
    a numpy array (a dozen numpy calls cost more than a list of one row, 100,000 times
    over); both hold version 4's columns (`crc_at` apart). Checksums kept by writers are
    fetched when first asked for (`fetch`), or for many tables at once by the caller."""

    def __init__(
        self,
        data: bytes,
        ndim: int,
        count: int,
        transforms: list[list[str]],
        where: str,
        version: int = VERSION,
        fetch: Fetch | None = None,
        shape: tuple[int, ...] | None = None,
    ) -> None:
        self.where, self.ndim, self.transforms = where, ndim, transforms
        self.fetch = fetch
        # its tensor's: no row past it has its checksums fetched (None: none bounds them)
        self.shape = (_LIMIT,) * ndim if shape is None else shape
        width, old = row_width(ndim, version), row_width(ndim, 4)
        col = row_columns(ndim)
        head = count * width * 8
        if len(data) < head or (len(data) - head) % 4:
            raise CorruptCheckpointError(
                f"{where}: a section of {len(data)} bytes cannot hold {count} chunk rows"
            )
        self.array: np.ndarray | None = None
        if count <= _FEW:
            values = _ints("q", data[:head])
            rows = [values[i * width : (i + 1) * width] for i in range(count)]
            self.rows = [row[:old] for row in rows]
            self.crc_at: Any = [row[col.crc_at] if width > old else -1 for row in rows]
            self.crcs: Any = _ints(_U32, data[head:])
            negative = min((row[col.crc_count] for row in self.rows), default=0) < 0
            counts = [
                row[col.crc_count] if at < 0 else 0 for row, at in zip(self.rows, self.crc_at)
            ]
            self.starts = [0, *itertools.accumulate(counts)]
            framed = any(row[col.frame] for row, at in zip(self.rows, self.crc_at) if at >= 0)
            lowest = min(values, default=0)
            boxes = min((v for row in self.rows for v in row[col.box]), default=0)
            highest = max(values, default=0)
            self._kept_at = np.asarray(self.crc_at, dtype=np.int64)
        else:
            full = np.frombuffer(data, dtype="<i8", count=count * width).reshape(count, width)
            self.array, self.rows = full[:, :old], []
            kept = full[:, col.crc_at] >= 0 if width > old else None
            self.crc_at = self._kept_at = (
                full[:, col.crc_at] if kept is not None else np.full(count, -1)
            )
            self.crcs = np.frombuffer(data, dtype="<u4", offset=head)
            raw = full[:, col.crc_count]
            negative = count > 0 and int(raw.min()) < 0
            if kept is not None and kept.all():  # a collective save's: none in the section
                self.starts = [0] * (count + 1)
                framed = bool(np.count_nonzero(full[:, col.frame]))
            else:
                inline = raw if kept is None else np.where(kept, 0, raw)
                self.starts = [0, *np.cumsum(inline).tolist()]
                framed = kept is not None and bool(np.count_nonzero(full[kept, col.frame]))
            lowest, highest = int(full.min()), int(full.max())
            boxes = int(full[:, col.box].min()) if ndim else 0
        if lowest < -1 or highest >= _LIMIT or negative or boxes < 0:
            raise CorruptCheckpointError(f"{where}: a chunk row holds an impossible value")
        if framed:  # a row whose writer keeps its frame holds none itself
            raise CorruptCheckpointError(f"{where}: a chunk row holds an impossible value")
        if self.starts[-1] != len(self.crcs):
            raise CorruptCheckpointError(
                f"{where}: its rows count {self.starts[-1]} checksums, it holds {len(self.crcs)}"
            )
        self.count = count
        self._kept: Kept | None = None
        self._first: np.ndarray | None = None  # each row's first inline checksum

    @property
    def kept(self) -> Kept:
        """What was fetched of the checksums its writers keep (made when first needed)."""
        if self._kept is None:
            self._kept = Kept(self.count)
        return self._kept

    def __len__(self) -> int:
        return self.count

    def overlapping(self, offsets: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """The rows whose boxes overlap the non-empty box (`offsets`, `sizes`)."""
        d = self.ndim
        if not d:
            return list(range(self.count))
        col = row_columns(d)
        if self.array is None:
            return [
                i
                for i, row in enumerate(self.rows)
                if overlap(row[col.offsets], row[col.sizes], offsets, sizes) is not None
            ]
        lo = np.asarray(offsets, dtype=np.int64)
        start, length = self.array[:, col.offsets], self.array[:, col.sizes]
        hit = ((start < lo + np.asarray(sizes)) & (start + length > lo) & (length > 0)).all(axis=1)
        return np.flatnonzero(hit).tolist()

    def entry(self, i: int, fetch: bool = True) -> ChunkEntry:
        """Row `i` as a manifest entry; its values are checked against each other and
        the tensor by the reader (`Manifest`'s geometry rules), as a JSON entry's are.
        `fetch=False`: checksums its writer keeps are not fetched if they were not yet;
        the entry then holds none and its `crc_at` says where they are (a rank that
        plans with a row another rank reads never needs them)."""
        col = row_columns(self.ndim)
        row = self.rows[i] if self.array is None else self.array[i].tolist()
        rank, k, token, frame, transform = (
            row[j] for j in (col.rank, col.k, col.token, col.frame, col.transform)
        )
        (rec_off, rec_len), (pay_off, pay_len) = row[col.record], row[col.payload]
        if token > TOKEN or transform >= len(self.transforms) or not 0 <= frame <= 0xFFFFFFFF:
            raise CorruptCheckpointError(f"{self.where}: chunk row {i} holds an impossible value")
        tile = tuple(row[col.tile])
        transformed = transform >= 0
        if -1 in (rank, k, rec_off, rec_len) or (pay_off == -1) != transformed:
            raise CorruptCheckpointError(f"{self.where}: chunk row {i} holds an impossible value")
        crc_at = -1  # its checksums are in the entry
        if self._kept_at[i] < 0:
            crcs = self.crcs[self.starts[i] : self.starts[i + 1]]
            crcs = crcs if self.array is None else crcs.tolist()
        elif not fetch and self.kept.frame[i] < 0:  # with its writer, not fetched: later
            frame, crcs, crc_at = 0, [], int(self._kept_at[i])
        else:  # with its writer: none when its count does not fit its grid (never fetched)
            if self.kept.frame[i] < 0:
                self.resolve([i])
            frame, crcs = self.kept.of(i)
        return ChunkEntry(
            tuple(row[col.offsets]),
            tuple(row[col.sizes]),
            file_of(rank, k, token),
            (rec_off, rec_len),
            None if transformed else (pay_off, pay_len),
            crcs,
            frame,
            self.transforms[transform] if transformed else None,
            None if transformed or -1 in tile else tile,
            crc_at,
        )

    def file_key(self, i: int) -> tuple[int, int, int]:
        """Row `i`'s data file as (rank, k, token): `file_of` names it."""
        col = row_columns(self.ndim)
        row = self.rows[i] if self.array is None else self.array[i]
        return int(row[col.rank]), int(row[col.k]), int(row[col.token])

    def crc_count(self, i: int) -> int:
        """How many checksums row `i` says its chunk has (not fetched: its row's count)."""
        col = row_columns(self.ndim)
        row = self.rows[i] if self.array is None else self.array[i]
        return int(row[col.crc_count])

    def place(self, i: int) -> tuple[str, int] | None:
        """Where row `i`'s record starts (its file, offset), its checksums not fetched:
        what orders values (`engine.load`); None when a value is impossible."""
        col = row_columns(self.ndim)
        row = self.rows[i] if self.array is None else self.array[i].tolist()
        rank, k, token, rec_off = row[col.rank], row[col.k], row[col.token], row[col.record][0]
        if min(rank, k, token, rec_off) < 0 or token > TOKEN:
            return None
        return file_of(rank, k, token), rec_off

    def candidates(self, rows: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Of `rows`, those whose writers keep their checksums, not fetched yet, and
        their version 4 columns: `format.table.fetchable` says which can be fetched."""
        if self.array is not None and len(rows) == 1:  # a piece in one chunk: the common case
            i = int(rows[0])
            if self._kept_at[i] < 0 or self.kept.frame[i] >= 0:
                return np.empty(0, dtype=np.int64), self.array[:0]
            return np.asarray([i]), self.array[i : i + 1]
        if self.array is None:  # a few rows: as lists
            picked = [
                i
                for i in sorted(set(np.asarray(rows).tolist()))
                if self._kept_at[i] >= 0 and self.kept.frame[i] < 0
            ]
            cols = np.asarray([self.rows[i] for i in picked], dtype=np.int64)
            return np.asarray(picked, dtype=np.int64), cols.reshape(-1, row_width(self.ndim, 4))
        wanted = np.unique(np.asarray(rows, dtype=np.int64))
        wanted = wanted[(self._kept_at[wanted] >= 0) & (self.kept.frame[wanted] < 0)]
        return wanted, self.array[wanted]

    def crc_at_of(self, rows: np.ndarray) -> np.ndarray:
        return self._kept_at[rows]

    def fill(
        self, rows: np.ndarray, frame: np.ndarray, first: np.ndarray, many: dict[int, np.ndarray]
    ) -> None:
        """What was fetched for `rows`; `many`: every checksum of rows holding more than one."""
        self.kept.fill(rows, frame, first)
        self.kept.many.update(many)

    def resolve(self, rows: Sequence[int] | np.ndarray) -> None:
        """Fetch the checksums of `rows` whose writers keep them, if not yet."""
        wanted, cols = self.candidates(rows)
        take = fetchable(cols, self.ndim, np.asarray(self.shape, dtype=np.int64))
        wanted, cols = wanted[take], cols[take]
        if not len(wanted):
            return
        if self.fetch is None:  # a reader's bug: a version 5 section read without its files
            raise CorruptCheckpointError(f"{self.where}: checksums kept with data, not read")
        d, at = 3 * self.ndim, self._kept_at[wanted]
        zero = np.zeros_like(at)
        frame, first, many = self.fetch(
            Slots(cols[:, d : d + 3], at, cols[:, -2], zero, [self.where])
        )
        self.fill(wanted, frame, first, {int(wanted[j]): crcs for j, crcs in many.items()})

    def first_crcs(self, rows: Sequence[int] | np.ndarray) -> np.ndarray:
        """Each of `rows`' first checksum (0 for a row with none): what a one-tile chunk
        is checked against. Array tables only."""
        rows = np.asarray(rows, dtype=np.int64)
        if self._first is None:
            starts = np.asarray(self.starts[:-1], dtype=np.int64)
            inline = np.append(np.asarray(self.crcs, dtype=np.uint32), np.uint32(0))
            self._first = inline[starts]
        kept = self._kept_at[rows] >= 0
        unfetched = rows[kept & (self.kept.frame[rows] < 0)]
        if len(unfetched):
            self.resolve(unfetched)
        return np.where(kept, self.kept.first[rows], self._first[rows])

    def files(self) -> set[str]:
        """The data files its rows name."""
        d = 3 * self.ndim
        named = (
            [row[d : d + 3] for row in self.rows]
            if self.array is None
            else np.unique(self.array[:, d : d + 3], axis=0).tolist()
        )
        return {file_of(rank, k, token) for rank, k, token in named if token <= TOKEN}

    def entries(self) -> list[ChunkEntry]:
        return [self.entry(i) for i in range(self.count)]


def _ints(code: str, data: bytes) -> list[int]:
    """Little-endian integers of `array` type `code` (8 or 4 bytes) as a list."""
    values = array(code)
    values.frombytes(data)
    if sys.byteorder != "little":
        values.byteswap()
    return values.tolist()


# -----------------------------------------------------------------------------
# A tensor's chunk entries encoded as its section of the index (`format.table` reads it).
#
# Rows of version 5: a chunk with a `crc_at` keeps its frame and checksums in its data
# file (a collective save's writers put them there), the others hold theirs in the
# section, after the rows.
# -----------------------------------------------------------------------------


def _file_parts(name: str) -> tuple[int, int, int]:
    found = DATA_FILE.fullmatch(name)
    if found is None:  # every writer names its files so: a writer's bug
        raise CorruptCheckpointError(f"{name!r} is not a data file name a section can hold")
    return int(found.group(1)), int(found.group(2)), int(found.group(3), 16)


def encode_section(chunks: Sequence[ChunkEntry], ndim: int, transforms: list[list[str]]) -> bytes:
    """The section of one tensor's `chunks` (entries as the manifest's model holds
    them); transforms not yet in `transforms` are added to it. A chunk whose
    checksums its writer keeps (`crc_at`) holds its tile grid's count of them there."""
    rows = np.empty((len(chunks), row_width(ndim)), dtype="<i8")
    crcs: list[int] = []
    for i, c in enumerate(chunks):
        if c.transform is None:
            transform = -1
        else:
            if c.transform not in transforms:
                transforms.append(c.transform)
            transform = transforms.index(c.transform)
        tile = c.tile if c.tile is not None else (-1,) * ndim
        payload = c.payload if c.payload is not None else (-1, -1)
        rows[i] = (
            *c.offsets,
            *c.sizes,
            *tile,
            *_file_parts(c.file),
            *c.record,
            *payload,
            c.frame if c.crc_at < 0 else 0,
            len(c.crcs) if c.crc_at < 0 else written_count(c),
            transform,
            c.crc_at,
        )
        if c.crc_at < 0:
            crcs += c.crcs
    return rows.tobytes() + np.asarray(crcs, dtype="<u4").tobytes()


# -----------------------------------------------------------------------------
# Many sections of one ndim decoded at once, with `ChunkTable`'s checks, as one array.
#
# A load of 100,000 small tensors reads 100,000 sections of a few rows each; a
# `ChunkTable` per section costs about 20 µs and a dozen objects. Here a group of
# sections is joined and checked with a few numpy passes: every rule
# `ChunkTable.__init__` applies to a section (lengths, impossible values, negative
# counts and boxes, frames held by rows their writers keep, the checksums counted)
# is applied per section, and a section failing any is only marked: its caller
# decodes it alone, as a `ChunkTable`, which names what is wrong.
# -----------------------------------------------------------------------------


@dataclass
class Rows:
    """The rows of a group of sections: row `i` is row `i - start[sec[i]]` of section
    `sec[i]`; `columns` its version 4 columns, `crc_at` where its writer keeps its
    checksums (-1: in the section), `first` its first checksum held in the section (0:
    none). `ok[s]`: section `s` passed every check (its rows are meaningful only then)."""

    columns: np.ndarray
    crc_at: np.ndarray
    first: np.ndarray
    sec: np.ndarray
    start: np.ndarray
    count: np.ndarray
    ok: np.ndarray


def decode(sections: list[tuple[bytes, int]], ndim: int, version: int) -> Rows:
    """Sections (their bytes, their row count) of tensors of `ndim` dimensions, of a
    manifest of `version`."""
    width, old = row_width(ndim, version), row_width(ndim, 4)
    heads, tails, counts, fits, lengths = [], [], [], [], []
    for data, rows in sections:
        head = rows * width * 8
        fit = len(data) >= head and (len(data) - head) % 4 == 0
        fits.append(fit)
        counts.append(rows if fit else 0)
        if fit:
            heads.append(data[:head])
            tails.append(data[head:])
        lengths.append((len(data) - head) // 4 if fit else 0)
    n = len(sections)
    count = np.asarray(counts, dtype=np.int64)
    start = np.zeros(n, dtype=np.int64)
    np.cumsum(count[:-1], out=start[1:])
    full = np.frombuffer(b"".join(heads), dtype="<i8").reshape(-1, width)
    crcs = np.frombuffer(b"".join(tails), dtype="<u4")
    sec = np.repeat(np.arange(n), count)
    col = row_columns(ndim)
    columns = full[:, :old]
    crc_at = full[:, col.crc_at] if width > old else np.full(len(full), -1, dtype=np.int64)
    kept = crc_at >= 0
    held = columns[:, col.crc_count]  # checksums counted: in the section unless kept
    bad = (held < 0) | (kept & (columns[:, col.frame] != 0))  # a kept row holds no frame
    if len(full):
        bad |= (full.min(axis=1) < -1) | (full.max(axis=1) >= _LIMIT)
        if ndim:
            bad |= columns[:, col.box].min(axis=1) < 0
    inline = np.where(kept, 0, held)
    bad |= inline > len(crcs)  # never a valid count: its sums below stay exact
    inline = np.where(bad, 0, inline)
    ok = np.asarray(fits, dtype=bool) & ~(np.bincount(sec, weights=bad, minlength=n) > 0)
    ok &= np.bincount(sec, weights=inline, minlength=n) == np.asarray(lengths, dtype=np.int64)
    before = np.cumsum(inline) - inline  # checksums of the group's rows before each row
    tail = np.zeros(n, dtype=np.int64)
    np.cumsum(np.asarray(lengths[:-1], dtype=np.int64), out=tail[1:])
    at = tail[sec] + before - before[start[sec]] if len(sec) else before
    usable = ok[sec] & (inline > 0)
    first = np.where(usable, np.append(crcs, np.uint32(0))[np.where(usable, at, len(crcs))], 0)
    return Rows(columns, crc_at, first.astype(np.uint32), sec, start, count, ok)


# -----------------------------------------------------------------------------
# The parts of a piece in small stored chunks, from a version 4 section, as arrays.
#
# A reshard reads parts of many chunks per piece: a column band of every row
# chunk of a tensor (1,000 tensors of 32 row chunks loaded by columns: 32,000
# parts on each rank). One entry, one storage info and one read request per part
# (`TensorChunks.covering`) cost about 80 µs a part; here the rows overlapping a
# piece are checked together with numpy, by the same rules — in bounds, byte
# ranges consistent with the sizes, one checksum tile, the rows covering the
# piece exactly once — and handed on as arrays (`Boxes`) that the read executor
# gathers (`io.chunks`), a few µs a part. Only plain one-tile chunks take
# this path (a part of one reads its whole payload to verify it anyway); for any
# other row, or anything wrong, `one_tile_boxes` returns None and the caller
# takes `covering`, whose checks name the problem.
# -----------------------------------------------------------------------------

_BYTES_LIMIT = float(1 << 62)  # bytes no chunk reaches: its int64 arithmetic stays exact


_BOUNDS = ((1 << 48) - 1, 0xFFFFFFFF)


@dataclass
class Boxes:
    """Parts of `k` stored chunks of one tensor: row `i` is the box at `inner[i]` of
    `lengths[i]` of its chunk (of `sizes[i]`), going to `dest[i]` of the piece. The
    chunk's payload is bytes `payload[i]` (offset, length) of its record `record[i]` in
    the data file named by `file[i]` (rank, k, token: `format.table.file_of`), its one
    checksum `crc[i]`."""

    file: np.ndarray  # (k, 3) int64
    record: np.ndarray  # (k, 2) int64
    payload: np.ndarray  # (k, 2) int64
    crc: np.ndarray  # (k,) uint32
    sizes: np.ndarray  # (k, d) int64
    inner: np.ndarray  # (k, d)
    lengths: np.ndarray  # (k, d)
    dest: np.ndarray  # (k, d)


def one_tile_boxes(
    chunks: TensorChunks, offsets: tuple[int, ...], sizes: tuple[int, ...], found: list[int]
) -> Boxes | None:
    """The parts of the non-empty piece (`offsets`, `sizes`) of `chunks`' tensor in the
    rows `found` (those overlapping it), when each is a plain one-tile chunk and they
    check out; their byte ranges are added to the load's (`chunks.spans`). None: take
    `covering`."""
    table = chunks.table
    array, d = table.array, table.ndim
    if array is None or not d or chunks.spans is None or not found:
        return None  # a few rows: `covering` builds them as fast
    lo, n = np.asarray(offsets, dtype=np.int64), np.asarray(sizes, dtype=np.int64)
    hit = np.asarray(found, dtype=np.int64)
    rows = array[hit]
    if chunks.plain is None:
        chunks.plain = plain_rows(chunks)
    if not chunks.plain[hit].all():
        return None
    col = row_columns(d)
    at, size = rows[:, col.offsets], rows[:, col.sizes]
    clo, chi = np.maximum(at, lo), np.minimum(at + size, lo + n)
    if not _tiles(clo, chi, lo, n):
        if _cut_dims(clo, chi, lo, n) < 2:
            return None  # a gap or an overlap along one dimension: `covering` names it
        boxes = [
            (tuple(x - y for x, y in zip(a, offsets)), tuple(y - x for x, y in zip(a, b)))
            for a, b in zip(clo.tolist(), chi.tolist())
        ]
        where = chunks.table.where
        check_coverage(f"{chunks.key} (at {offsets})", sizes, boxes, where, replicas=False)
    file = slice(col.rank, col.token + 1)  # rank k token: the data file's name
    chunks.spans.add(chunks.key, hit, rows[:, col.rank : col.record.stop])
    return Boxes(
        rows[:, file],
        rows[:, col.record],
        rows[:, col.payload],
        table.first_crcs(hit),
        size,
        clo - at,
        chi - clo,
        clo - lo,
    )


def row_strides(sizes: np.ndarray) -> np.ndarray:
    """Each row's C-order element strides of an array of that row's `sizes`."""
    out = np.ones_like(sizes)
    for j in range(sizes.shape[1] - 2, -1, -1):
        out[:, j] = out[:, j + 1] * sizes[:, j + 1]
    return out


def dense(boxes: Boxes, itemsize: int) -> bool:
    """Whether reading each part's bytes from its first to its last reads only what a
    ranged read of its runs would (`format.checksums.spans`: runs closer than `MERGE_GAP` are
    read together): no gap between its runs reaches `MERGE_GAP`."""
    sizes, lengths = boxes.sizes, boxes.lengths
    strides = row_strides(sizes)
    # from a run's start in dimension j to the next one's: its stride, less the extent
    # of one step's box in the dimensions after j
    extent = np.cumsum(((lengths - 1) * strides)[:, ::-1], axis=1)[:, ::-1]
    gaps = (strides[:, :-1] - extent[:, 1:] - 1) * itemsize
    return not ((lengths[:, :-1] > 1) & (gaps >= MERGE_GAP)).any()


def plain_rows(chunks: TensorChunks) -> np.ndarray:
    """Which rows of the section are plain one-tile chunks that check out alone: once a
    tensor, for all its pieces."""
    table = chunks.table
    assert table.array is not None
    shape = np.asarray(chunks.entry.shape, dtype=np.int64)
    return plain(table.array, shape, chunks.itemsize)


def plain(array: np.ndarray, shape: np.ndarray, itemsize: np.ndarray | int) -> np.ndarray:
    """Which section rows (`array`, of tensors of `shape` and `itemsize`: one, or one per
    row) are plain one-tile chunks that check out alone: in bounds, byte ranges
    consistent with the sizes, names and frame possible."""
    col = row_columns((array.shape[1] - row_width(0, 4)) // 3)
    at, size, tile = array[:, col.offsets], array[:, col.sizes], array[:, col.tile]
    (rec_off, rec_len), (pay_off, pay_len) = array[:, col.record].T, array[:, col.payload].T
    inside = (at + size <= shape).all(axis=1)
    ok = (
        inside
        & (tile == size).all(axis=1)
        & (array[:, [col.rank, col.k, *_range(col.record), col.frame]] >= 0).all(axis=1)
        & (array[:, [col.token, col.frame]] <= _BOUNDS).all(axis=1)  # 48 bits, a crc32c
        & (array[:, [col.crc_count, col.transform]] == (1, -1)).all(axis=1)  # one crc, no transform
        & (pay_off >= rec_off)
        & (pay_off + pay_len <= rec_off + rec_len)
    )
    # the bytes of a chunk in the shape may still pass 2**63: bounded first, in floats
    size = np.where(inside[:, None], size, 0)
    ok &= size.astype(np.float64).prod(axis=1) * itemsize < _BYTES_LIMIT
    return ok & (pay_len == np.where(ok[:, None], size, 0).prod(axis=1) * itemsize)


def _cut_dims(clo: np.ndarray, chi: np.ndarray, lo: np.ndarray, n: np.ndarray) -> int:
    """In how many dimensions the clipped boxes do not all span the piece."""
    return int((~((clo == lo) & (chi == lo + n)).all(axis=0)).sum())


def _tiles(clo: np.ndarray, chi: np.ndarray, lo: np.ndarray, n: np.ndarray) -> bool:
    """Whether the clipped boxes tile the piece exactly, cut along one dimension (or
    one box, the whole piece): the common layouts, checked in O(k log k)."""
    full = ((clo == lo) & (chi == lo + n)).all(axis=0)
    cut = np.flatnonzero(~full)
    if not len(cut):
        return len(clo) == 1
    if len(cut) > 1:
        return False
    c = int(cut[0])
    order = np.argsort(clo[:, c], kind="stable")
    s, e = clo[order, c], chi[order, c]
    return bool(s[0] == lo[c] and e[-1] == lo[c] + n[c] and (s[1:] == e[:-1]).all())


# -----------------------------------------------------------------------------
# `one_tile_boxes` for every piece of a load at once: its rows checked by a few numpy
# passes over all of them, not a few dozen numpy calls a piece.
#
# A reshard rank with one piece in each of 1,000 tensors spent about 100 µs a
# piece checking its rows one piece at a time. Here the rows each piece overlaps
# (found in its tensor's section: `ChunkTable.overlapping`) are stacked, for all
# pieces of one ndim, and the same rules applied per piece with sorted segment
# operations: every row the piece overlaps a plain one-tile chunk (`format.table.plain`'s
# rules), at least two of them, the clipped boxes cut along one dimension and
# tiling it exactly. A piece that passes gets its `Boxes` (rows in the order they
# tile it); any other gets None and goes the one-piece way (`one_tile_boxes`,
# then `covering`), which accepts the rarer layouts or names what is wrong.
# -----------------------------------------------------------------------------

PAIRS = 1 << 17  # (piece, row) pairs tested at once: a few MiB of arrays

# a tensor's chunks, a piece (offsets, sizes) and the rows of its section it overlaps
Item = tuple["TensorChunks", tuple[int, ...], tuple[int, ...], list[int]]


def batch_boxes(items: Sequence[Item]) -> list[Boxes | None]:
    """The `Boxes` of each piece (None: take it alone), their byte ranges added to
    each tensor's load (`TensorChunks.spans`)."""
    out: list[Boxes | None] = [None] * len(items)
    by_ndim: dict[int, list[int]] = {}
    for i, (chunks, offsets, _sizes, found) in enumerate(items):
        if chunks.table.array is not None and offsets and chunks.spans is not None and found:
            by_ndim.setdefault(len(offsets), []).append(i)
    for d, which in by_ndim.items():
        start = 0
        while start < len(which):  # at most PAIRS (piece, row) pairs at once, or one piece
            end, pairs = start, 0
            while end < len(which) and (end == start or pairs < PAIRS):
                pairs += len(items[which[end]][3])
                end += 1
            part = which[start:end]
            for i, boxes in zip(part, _batch([items[i] for i in part], d), strict=True):
                out[i] = boxes
            start = end
    return out


def _batch(items: list[Item], d: int) -> list[Boxes | None]:
    m = len(items)
    per = np.asarray([len(found) for *_, found in items])
    local = np.concatenate([np.asarray(found, dtype=np.int64) for *_, found in items])
    rows = np.concatenate([c.table.array[found] for c, _o, _s, found in items])  # type: ignore[index]
    crcs = np.concatenate([c.table.first_crcs(found) for c, _o, _s, found in items])
    shapes = np.asarray([c.entry.shape for c, *_ in items], dtype=np.int64).reshape(-1, d)
    sizes = np.asarray([c.itemsize for c, *_ in items], dtype=np.int64)
    usable = plain(rows, np.repeat(shapes, per, axis=0), np.repeat(sizes, per))
    lo = np.asarray([o for _c, o, _s, _f in items], dtype=np.int64).reshape(-1, d)
    n = np.asarray([s for _c, _o, s, _f in items], dtype=np.int64).reshape(-1, d)
    piece = np.repeat(np.arange(m), per)
    row = np.arange(len(piece))  # in `rows`
    col = row_columns(d)
    at, size, plo, pn = rows[:, col.offsets], rows[:, col.sizes], lo[piece], n[piece]
    hit = ((at < plo + pn) & (at + size > plo) & (size > 0)).all(axis=1)  # as found: checked
    pairs = _Pairs(piece[hit], local[hit], row[hit], at[hit], size[hit], plo[hit], pn[hit])
    found = np.bincount(pairs.piece, minlength=m)
    bad = np.bincount(pairs.piece, weights=~usable[pairs.row], minlength=m) > 0
    full = (pairs.clo == pairs.plo) & (pairs.chi == pairs.plo + pairs.pn)
    cuts = np.zeros((m, d), dtype=bool)
    np.logical_or.at(cuts, pairs.piece, ~full)
    ok = (found >= 2) & ~bad & (cuts.sum(axis=1) == 1)
    cut = cuts.argmax(axis=1)  # the one dimension the piece's boxes cut
    pairs = pairs.take(ok[pairs.piece])
    if not len(pairs.piece):
        return [None] * m
    c = cut[pairs.piece]
    start = pairs.clo[np.arange(len(c)), c]
    pairs = pairs.take(np.lexsort((start, pairs.piece)))  # each piece's boxes along its cut
    c = cut[pairs.piece]
    start, end = pairs.clo[np.arange(len(c)), c], pairs.chi[np.arange(len(c)), c]
    base, span = pairs.plo[np.arange(len(c)), c], pairs.pn[np.arange(len(c)), c]
    head = np.append(True, pairs.piece[1:] != pairs.piece[:-1])
    tail = np.append(head[1:], True)
    wrong = (head & (start != base)) | (tail & (end != base + span))
    wrong[1:] |= ~head[1:] & (start[1:] != end[:-1])  # a gap or an overlap between neighbours
    ok &= np.bincount(pairs.piece, weights=wrong, minlength=m) == 0
    pairs = pairs.take(ok[pairs.piece])
    return _boxes(items, pairs, rows, crcs, d) if len(pairs.piece) else [None] * m


class _Pairs:
    """(piece, row) pairs as columns: the row's box and the piece's, clipped."""

    def __init__(self, *columns: np.ndarray) -> None:
        self.piece, self.local, self.row, self.at, self.size, self.plo, self.pn = columns
        self.clo = np.maximum(self.at, self.plo)
        self.chi = np.minimum(self.at + self.size, self.plo + self.pn)

    def take(self, which: np.ndarray) -> _Pairs:
        out = _Pairs.__new__(_Pairs)
        for name in ("piece", "local", "row", "at", "size", "plo", "pn", "clo", "chi"):
            setattr(out, name, getattr(self, name)[which])
        return out


def _boxes(
    items: list[Item], pairs: _Pairs, rows: np.ndarray, crcs: np.ndarray, d: int
) -> list[Boxes | None]:
    """Each accepted piece's `Boxes`; its rows' byte ranges added to its load's."""
    stored = rows[pairs.row, row_columns(d).stored]  # rank k token record (2) payload (2)
    inner, lengths, dest = pairs.clo - pairs.at, pairs.chi - pairs.clo, pairs.clo - pairs.plo
    first = np.flatnonzero(np.append(True, pairs.piece[1:] != pairs.piece[:-1]))
    bounds = [*first.tolist(), len(pairs.piece)]
    out: list[Boxes | None] = [None] * len(items)
    for a, b in zip(bounds, bounds[1:]):
        p = int(pairs.piece[a])
        chunks = items[p][0]
        assert chunks.spans is not None
        chunks.spans.add(chunks.key, pairs.local[a:b], stored[a:b, :5])  # through the record
        out[p] = Boxes(
            stored[a:b, :3],
            stored[a:b, 3:5],
            stored[a:b, 5:7],
            crcs[pairs.row[a:b]],
            pairs.size[a:b],
            inner[a:b],
            lengths[a:b],
            dest[a:b],
        )
    return out
