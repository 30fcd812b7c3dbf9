"""What a load of a version 4 index reads, checked before any byte is: every row's and
object's byte range inside its data file, none in the index file, no two overlapping.

Rows found one at a time land in `Ranges` (a dict); rows found as arrays — a
reshard's parts (`row_boxes`), a load's whole chunks (`engine.whole_rows`) — in
`RowSpans`, one array per batch, checked with a few numpy passes over all of
them (a dict entry per row costs about 170 bytes: 17 MiB at 100,000 rows).
"""

from __future__ import annotations

import numpy as np

from ...errors import CorruptCheckpointError
from ...storage import Folder
from .chunk_table import file_of
from .record_check import DATA_FILE, check_ranges

__all__ = ["Ranges", "RowSpans", "check_read_ranges"]


# what a load reads, by tensor key and row (an object: row -1), as (key, file, offset, length)
Ranges = dict[tuple[str, int], tuple[str, str, int, int]]


class RowSpans:
    """The byte ranges of rows a load found as arrays (`row_boxes`, `whole_rows`): arrays
    of (key id, row, rank, k, token, offset, length), one per piece or batch."""

    def __init__(self) -> None:
        self.names: list[str] = []  # by key id
        self.keys: dict[str, int] = {}  # the ids of keys added one at a time (`add`)
        self.parts: list[np.ndarray] = []

    def add(self, key: str, rows: np.ndarray, where: np.ndarray) -> None:
        """Rows `rows` of `key`'s section, `where` they are: (rank, k, token, offset, length)."""
        kid = self.keys.get(key)
        if kid is None:
            kid = self.keys[key] = len(self.names)
            self.names.append(key)
        ids = np.full(len(rows), kid, dtype=np.int64)
        self.parts.append(np.column_stack([ids, rows, where]))

    def add_many(
        self, keys: list[str], which: np.ndarray, rows: np.ndarray, where: np.ndarray
    ) -> None:
        """Rows `rows` of the sections of `keys[which]`, `where` they are, as `add`: keys
        added by no other call (a load takes each key's section once), so with ids of
        their own, not in `keys` (a dict entry a key: 100 bytes, 10 MiB at 100,000)."""
        base = len(self.names)
        self.names += keys
        self.parts.append(np.column_stack([which + base, rows, where]))


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
            key = spans.names[int(found[hit[0], 0])]
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
    keys = spans.names
    out = dict(ranges)
    for part in spans.parts:
        for kid, row, rank, k, token, at, n in part.tolist():
            out.setdefault((keys[kid], row), (keys[kid], file_of(rank, k, token), at, n))
    return list(out.values())
