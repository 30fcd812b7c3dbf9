"""A tensor's stored chunks as one binary section of the index (format version 4).

From version 4 the manifest lists each tensor's dtype and shape but not its
chunks: they are rows of fixed-width integers in a section of the checkpoint's
index file, which the manifest points at (offset, length, row count, crc32c).
A loading rank reads only the sections of the tensors it loads and keeps only
the rows that overlap what it loads (one vectorised comparison per piece),
building entries for those alone: its planning depends on what it loads, not
on every chunk of every rank, which a JSON list made it parse (1,024 ranks ×
1,000 tensors: a million chunks, seconds and gigabytes on every rank).

A section, little-endian: `count` rows of `3 * ndim + 10` int64 columns, then the
tile checksums of every row, in row order, as uint32:

    offsets[ndim] sizes[ndim] tile[ndim] rank k token record_offset record_length
    payload_offset payload_length frame crc_count transform

`rank`, `k` and `token` (48 bits) name the data file `__{rank}_{k}.sw{token}.distcp`,
so no name in a section can leave the folder; a transformed chunk has `-1` for its
tile and payload, and its transform is an index into the tensor's `transforms`.
"""

from __future__ import annotations

import itertools
import math
import sys
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...errors import CorruptCheckpointError
from .manifest_entries import ChunkEntry
from .record_check import DATA_FILE
from .tiles import tile_count, valid_tile

__all__ = [
    "ChunkTable",
    "chunk_consistent",
    "encode_section",
    "file_of",
    "row_width",
]

_LIMIT = 1 << 62  # no stored integer reaches it: sums of two stay in int64
_TOKEN = (1 << 48) - 1
_FEW = 16  # rows up to which a section is decoded to lists
_U32 = next(code for code in "IL" if array(code).itemsize == 4)


def row_width(ndim: int) -> int:
    return 3 * ndim + 10


def file_of(rank: int, k: int, token: int) -> str:
    return f"__{rank}_{k}.sw{token:012x}.distcp"


def _file_parts(name: str) -> tuple[int, int, int]:
    found = DATA_FILE.fullmatch(name)
    if found is None:  # every writer names its files so: a writer's bug
        raise CorruptCheckpointError(f"{name!r} is not a data file name a section can hold")
    return int(found.group(1)), int(found.group(2)), int(found.group(3), 16)


def encode_section(chunks: Sequence[ChunkEntry], ndim: int, transforms: list[list[str]]) -> bytes:
    """The section of one tensor's `chunks` (entries as the manifest's model holds
    them); transforms not yet in `transforms` are added to it."""
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
            c.frame,
            len(c.crcs),
            transform,
        )
        crcs += c.crcs
    return rows.tobytes() + np.asarray(crcs, dtype="<u4").tobytes()


class ChunkTable:
    """One tensor's section, decoded and checked as a table: which rows overlap a
    box, and the entries of the rows a reader asks for. A few rows (most tensors: one
    chunk, or one per rank of a small job) are plain lists, the rest a numpy array:
    a dozen numpy calls cost more than a list of one row, 100,000 times over."""

    def __init__(
        self, data: bytes, ndim: int, count: int, transforms: list[list[str]], where: str
    ) -> None:
        self.where, self.ndim, self.transforms = where, ndim, transforms
        width = row_width(ndim)
        head = count * width * 8
        if len(data) < head or (len(data) - head) % 4:
            raise CorruptCheckpointError(
                f"{where}: a section of {len(data)} bytes cannot hold {count} chunk rows"
            )
        self.array: np.ndarray | None = None
        if count <= _FEW:
            values = _ints("q", data[:head])
            self.rows = [values[i * width : (i + 1) * width] for i in range(count)]
            self.crcs: Any = _ints(_U32, data[head:])
            counts = [row[-2] for row in self.rows]
            lowest = min(values, default=0)
            boxes = min((v for row in self.rows for v in row[: 2 * ndim]), default=0)
            highest = max(values, default=0)
        else:
            array = np.frombuffer(data, dtype="<i8", count=count * width).reshape(count, width)
            self.array, self.rows = array, []
            self.crcs = np.frombuffer(data, dtype="<u4", offset=head)
            counts = array[:, -2].tolist()
            lowest, highest = int(array.min()), int(array.max())
            boxes = int(array[:, : 2 * ndim].min()) if ndim else 0
        if lowest < -1 or highest >= _LIMIT or min(counts, default=0) < 0 or boxes < 0:
            raise CorruptCheckpointError(f"{where}: a chunk row holds an impossible value")
        if sum(counts) != len(self.crcs):
            raise CorruptCheckpointError(
                f"{where}: its rows count {sum(counts)} checksums, it holds {len(self.crcs)}"
            )
        self.starts = [0, *itertools.accumulate(counts)]
        self.count = count

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
        if token > _TOKEN or transform >= len(self.transforms) or not 0 <= frame <= 0xFFFFFFFF:
            raise CorruptCheckpointError(f"{self.where}: chunk row {i} holds an impossible value")
        tile = tuple(row[2 * d : 3 * d])
        transformed = transform >= 0
        if -1 in (rank, k, rec_off, rec_len) or (pay_off == -1) != transformed:
            raise CorruptCheckpointError(f"{self.where}: chunk row {i} holds an impossible value")
        crcs = self.crcs[self.starts[i] : self.starts[i + 1]]
        return ChunkEntry(
            tuple(row[:d]),
            tuple(row[d : 2 * d]),
            file_of(rank, k, token),
            (rec_off, rec_len),
            None if transformed else (pay_off, pay_len),
            crcs if self.array is None else crcs.tolist(),
            frame,
            self.transforms[transform] if transformed else None,
            None if transformed or -1 in tile else tile,
        )

    def files(self) -> set[str]:
        """The data files its rows name."""
        d = 3 * self.ndim
        named = (
            [row[d : d + 3] for row in self.rows]
            if self.array is None
            else np.unique(self.array[:, d : d + 3], axis=0).tolist()
        )
        return {file_of(rank, k, token) for rank, k, token in named if token <= _TOKEN}

    def entries(self) -> list[ChunkEntry]:
        return [self.entry(i) for i in range(self.count)]


def _ints(code: str, data: bytes) -> list[int]:
    """Little-endian integers of `array` type `code` (8 or 4 bytes) as a list."""
    values = array(code)
    values.frombytes(data)
    if sys.byteorder != "little":
        values.byteswap()
    return values.tolist()


def chunk_consistent(c: ChunkEntry, itemsize: int, version: int, page_size: int) -> bool:
    """The byte ranges and checksums of a chunk fit each other and its size."""
    if c.payload is None:  # transformed: one checksum over the stored record
        return bool(c.transform) and c.tile is None and len(c.crcs) == 1
    nbytes = math.prod(c.sizes) * itemsize
    if not (
        c.payload[1] == nbytes
        and c.record[0] <= c.payload[0] <= c.payload[0] + c.payload[1] <= sum(c.record)
    ):
        return False
    if version <= 2:  # pages: at least one (an empty payload has one empty page)
        return len(c.crcs) == max(1, -(-nbytes // page_size))
    if c.tile is None:  # no checksums at all: only a transformed chunk has no tiles
        return False
    if c.tile == c.sizes:  # one tile, the common case for small chunks
        return len(c.crcs) == 1
    return valid_tile(c.sizes, c.tile) and len(c.crcs) == tile_count(c.sizes, c.tile)
