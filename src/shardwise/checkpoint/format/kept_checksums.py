"""The checksums a section's rows keep in their writers' data files (format version 5),
as arrays: which rows can be fetched, and what was fetched.

A column rank of a reshard takes a band of every chunk of every tensor: 32,000
rows at 32 ranks × 1,000 tensors. Row by row in Python their checksums cost more
than the load's reads; as arrays they cost a few numpy passes (`writer_checksums`
reads them, `chunk_table.ChunkTable` keeps them here).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .manifest_entries import ChunkEntry
from .tiles import tile_count, valid_tile

__all__ = ["TOKEN", "Kept", "Slots", "fetchable", "written_count"]

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
    d = ndim
    offsets, sizes, tile = cols[:, :d], cols[:, d : 2 * d], cols[:, 2 * d : 3 * d]
    rank, k, token = cols[:, 3 * d], cols[:, 3 * d + 1], cols[:, 3 * d + 2]
    count, transform = cols[:, -2], cols[:, -1]
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
