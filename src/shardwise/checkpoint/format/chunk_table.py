"""A tensor's stored chunks as one binary section of the index (format versions 4, 5).

From version 4 the manifest lists each tensor's dtype and shape but not its
chunks: they are rows of fixed-width integers in a section of the index file.
A loading rank reads only the sections of the tensors it loads and keeps only
the rows that overlap what it loads (one vectorised comparison per piece): its
planning depends on what it loads, not on every chunk of every rank (1,024
ranks × 1,000 tensors: a million chunks).

A section, little-endian: `count` rows of `3 * ndim + 11` int64 columns (10 up
to version 4, without `crc_at`), then the checksums of the rows that hold theirs
(`crc_at` -1), in row order, as uint32:

    offsets[ndim] sizes[ndim] tile[ndim] rank k token record_offset record_length
    payload_offset payload_length frame crc_count transform crc_at

`rank`, `k` and `token` (48 bits) name the data file `__{rank}_{k}.sw{token}.distcp`,
so no name in a section can leave the folder; a transformed chunk has `-1` for its
tile and payload, and its transform is an index into the tensor's `transforms`.
From version 5 a row's frame and checksums may stay with its writer: `crc_at` is
where its data file holds them (`1 + crc_count` uint32, the frame first) and its
`frame` column is 0. A collective save writes them so: its rows are then known
from the plan alone, and a repeated save exchanges no checksums
(`writer_checksums`, which fetches them for the rows a reader takes).
"""

from __future__ import annotations

import itertools
import sys
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ...errors import CorruptCheckpointError
from .kept_checksums import TOKEN, Kept, Slots, fetchable
from .manifest_entries import VERSION, ChunkEntry

__all__ = [
    "ChunkTable",
    "file_of",
    "row_width",
]

_LIMIT = 1 << 62  # no stored integer reaches it: sums of two stay in int64
_FEW = 16  # rows up to which a section is decoded to lists
_U32 = next(code for code in "IL" if array(code).itemsize == 4)


def row_width(ndim: int, version: int = VERSION) -> int:
    return 3 * ndim + (11 if version >= 5 else 10)


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
            self.crc_at: Any = [row[old] if width > old else -1 for row in rows]
            self.crcs: Any = _ints(_U32, data[head:])
            negative = min((row[-2] for row in self.rows), default=0) < 0
            counts = [row[-2] if at < 0 else 0 for row, at in zip(self.rows, self.crc_at)]
            self.starts = [0, *itertools.accumulate(counts)]
            framed = any(row[-3] for row, at in zip(self.rows, self.crc_at) if at >= 0)
            lowest = min(values, default=0)
            boxes = min((v for row in self.rows for v in row[: 2 * ndim]), default=0)
            highest = max(values, default=0)
            self._kept_at = np.asarray(self.crc_at, dtype=np.int64)
        else:
            full = np.frombuffer(data, dtype="<i8", count=count * width).reshape(count, width)
            self.array, self.rows = full[:, :old], []
            kept = full[:, old] >= 0 if width > old else None
            self.crc_at = self._kept_at = full[:, old] if kept is not None else np.full(count, -1)
            self.crcs = np.frombuffer(data, dtype="<u4", offset=head)
            raw = full[:, old - 2]
            negative = count > 0 and int(raw.min()) < 0
            if kept is not None and kept.all():  # a collective save's: none in the section
                self.starts = [0] * (count + 1)
                framed = bool(np.count_nonzero(full[:, old - 3]))
            else:
                inline = raw if kept is None else np.where(kept, 0, raw)
                self.starts = [0, *np.cumsum(inline).tolist()]
                framed = kept is not None and bool(np.count_nonzero(full[kept, old - 3]))
            lowest, highest = int(full.min()), int(full.max())
            boxes = int(full[:, : 2 * ndim].min()) if ndim else 0
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
        if self.array is None:
            return [
                i
                for i, row in enumerate(self.rows)
                if all(
                    row[j] < offsets[j] + sizes[j]
                    and row[j] + row[d + j] > offsets[j]
                    and row[d + j] > 0
                    for j in range(d)
                )
            ]
        lo = np.asarray(offsets, dtype=np.int64)
        start, length = self.array[:, :d], self.array[:, d : 2 * d]
        hit = ((start < lo + np.asarray(sizes)) & (start + length > lo) & (length > 0)).all(axis=1)
        return np.flatnonzero(hit).tolist()

    def entry(self, i: int) -> ChunkEntry:
        """Row `i` as a manifest entry; its values are checked against each other and
        the tensor by the reader (`Manifest`'s geometry rules), as a JSON entry's are."""
        d = self.ndim
        row = self.rows[i] if self.array is None else self.array[i].tolist()
        rank, k, token, rec_off, rec_len, pay_off, pay_len, frame, _, transform = row[3 * d :]
        if token > TOKEN or transform >= len(self.transforms) or not 0 <= frame <= 0xFFFFFFFF:
            raise CorruptCheckpointError(f"{self.where}: chunk row {i} holds an impossible value")
        tile = tuple(row[2 * d : 3 * d])
        transformed = transform >= 0
        if -1 in (rank, k, rec_off, rec_len) or (pay_off == -1) != transformed:
            raise CorruptCheckpointError(f"{self.where}: chunk row {i} holds an impossible value")
        if self._kept_at[i] < 0:
            crcs = self.crcs[self.starts[i] : self.starts[i + 1]]
            crcs = crcs if self.array is None else crcs.tolist()
        else:  # with its writer: none when its count does not fit its grid (never fetched)
            if self.kept.frame[i] < 0:
                self.resolve([i])
            frame, crcs = self.kept.of(i)
        return ChunkEntry(
            tuple(row[:d]),
            tuple(row[d : 2 * d]),
            file_of(rank, k, token),
            (rec_off, rec_len),
            None if transformed else (pay_off, pay_len),
            crcs,
            frame,
            self.transforms[transform] if transformed else None,
            None if transformed or -1 in tile else tile,
        )

    def place(self, i: int) -> tuple[str, int] | None:
        """Where row `i`'s record starts (its file, offset), its checksums not fetched:
        what orders values (`engine.replicated`); None when a value is impossible."""
        d = self.ndim
        row = self.rows[i] if self.array is None else self.array[i].tolist()
        rank, k, token, rec_off = row[3 * d : 3 * d + 4]
        if min(rank, k, token, rec_off) < 0 or token > TOKEN:
            return None
        return file_of(rank, k, token), rec_off

    def candidates(self, rows: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Of `rows`, those whose writers keep their checksums, not fetched yet, and
        their version 4 columns: `kept_checksums.fetchable` says which can be fetched."""
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
