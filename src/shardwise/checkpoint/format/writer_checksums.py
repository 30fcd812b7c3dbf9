"""Checksums kept by their writers (format version 5), fetched for the rows a reader takes.

A collective save's writer puts each chunk's frame and tile checksums in its own
data file, after its records (`engine.rank_file`): the index rows then follow
from the plan alone, so a repeated save of one structure routes no checksums to
the keys' owners and exchanges a few bytes per rank (`engine.saving`). A reader
fetches them only for the rows it takes, per data file, the wanted slots in runs
(slots less than `GAP` apart read together): a rank loading its own 1,000 chunks
reads one run of 8 KB of its writer's file, a rank loading a column of every
writer's chunks one run per writer. Nothing is read before its range is checked:
inside a plain data file of the listing (never the index), no two slots
overlapping, so what is read is bounded by the files' real sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ...errors import CorruptCheckpointError
from ...storage import Folder
from .chunk_table import ChunkTable, Fetch, file_of
from .kept_checksums import Slots, fetchable

__all__ = ["GAP", "Pending", "fetch_slots", "fetcher", "resolve_rows"]

GAP = 4096  # bytes between two wanted slots of a file below which both are one read

# what a fetch gives: each slot's frame and first checksum, all of those with more
Fetched = tuple[np.ndarray, np.ndarray, dict[int, np.ndarray]]


def fetcher(folder: Folder, listing: dict[str, int], index: str) -> Fetch:
    """The fetch of the tables a reader decodes from `folder`'s index file `index`."""

    def fetch(slots: Slots) -> Fetched:
        return fetch_slots(folder, listing, index, slots)

    return fetch


def fetch_slots(folder: Folder, listing: dict[str, int], index: str, slots: Slots) -> Fetched:
    """Each slot's frame and checksums, read file by file in runs of neighbours, each
    file's slots checked first (`_runs`)."""
    n = len(slots.at)
    frame, first = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.uint32)
    many: dict[int, np.ndarray] = {}
    files, which = _files(slots.files)
    order = np.lexsort((slots.at, which.reshape(-1)))
    bounds = np.searchsorted(which.reshape(-1)[order], np.arange(len(files) + 1))
    for f, (rank, k, token) in enumerate(files.tolist()):
        mine = order[bounds[f] : bounds[f + 1]]
        name = file_of(rank, k, token)
        at = slots.at[mine]
        count = np.minimum(slots.count[mine], 1 << 58)  # past any file: `stop` cannot wrap
        stop = at + 4 * (1 + count)
        handle = None
        try:
            for lo, hi in _runs(folder, listing, index, name, (mine, at, stop), slots):
                start, end = int(at[lo]), int(stop[hi - 1])
                handle = handle or folder.open(name)
                data = handle.pread(end - start, start)
                if len(data) != end - start:
                    where = slots.names[slots.table[mine[lo]]]
                    raise CorruptCheckpointError(
                        f"{where}: chunk checksums at bytes {start}..{end} of data file "
                        f"{folder.where(name)} cut short (truncated)"
                    )
                _decode(data, at[lo:hi] - start, count[lo:hi], mine[lo:hi], (frame, first, many))
        finally:
            if handle is not None:
                handle.close()
    return frame, first, many


@dataclass
class Pending:
    """Slots a caller fetches with the rows of tables (`resolve_rows`): `slots.table`
    indexes `slots.names`; `fill` is handed each slot's frame and first checksum."""

    slots: Slots
    fill: Callable[[np.ndarray, np.ndarray], None]


def resolve_rows(
    pairs: Sequence[tuple[ChunkTable, Sequence[int]]],
    pending: Sequence[Pending] = (),
    fetch: Fetch | None = None,
) -> None:
    """Fetch, in one pass over the files, the checksums of every table's rows whose
    writers keep them (`ChunkTable.resolve` for many tables), and the `pending` slots
    (with `fetch`, where no table is asked): which can be fetched is one numpy pass per
    ndim over all of them (`kept_checksums.fetchable`); every slot is checked with all
    the others before its file is read (`fetch_slots`)."""
    rows_of: dict[int, list[Sequence[int]]] = {}
    tables: dict[int, ChunkTable] = {}
    for table, some in pairs:
        if len(some):
            rows_of.setdefault(id(table), []).append(some)
            tables[id(table)] = table
    by_ndim: dict[int, list[tuple[ChunkTable, np.ndarray, np.ndarray]]] = {}
    for key, table in tables.items():
        asked_rows = rows_of[key]
        joined = asked_rows[0] if len(asked_rows) == 1 else np.concatenate(asked_rows)
        wanted, cols = table.candidates(joined)
        if len(wanted):
            by_ndim.setdefault(table.ndim, []).append((table, wanted, cols))
    asked: list[tuple[ChunkTable, np.ndarray]] = []
    parts: list[tuple[np.ndarray, ...]] = []
    for ndim, found in by_ndim.items():
        cols = np.concatenate([c for _t, _r, c in found])
        lengths = [len(r) for _t, r, _c in found]
        shapes = np.asarray([t.shape for t, _r, _c in found], dtype=np.int64)
        shapes = np.repeat(shapes.reshape(len(found), ndim), lengths, axis=0)
        take = fetchable(cols, ndim, shapes)  # sorted
        owner = np.repeat(
            np.arange(len(asked), len(asked) + len(found)), [len(r) for _t, r, _c in found]
        )
        taken = np.concatenate([r for _t, r, _c in found])
        at = np.concatenate([t.crc_at_of(r) for t, r, _c in found])
        asked += [(t, r) for t, r, _c in found]
        d = 3 * ndim
        parts.append((cols[take, d : d + 3], at[take], cols[take, -2], owner[take], taken[take]))
    names = [t.where for t, _r in asked]
    mine = sum(len(p[1]) for p in parts)  # the tables' slots, first
    for p in pending:
        s = p.slots
        parts.append((s.files, s.at, s.count, s.table + len(names), np.zeros_like(s.at)))
        names += s.names
    if not parts:
        return
    files, at, count, owners, rows = (np.concatenate([p[i] for p in parts]) for i in range(5))
    slots = Slots(files.reshape(-1, 3), at, count, owners, names)
    if not len(slots.at):
        return
    fetch = asked[0][0].fetch if asked else fetch
    if fetch is None:  # a reader's bug: a version 5 section read without its files
        raise CorruptCheckpointError(f"{names[0]}: checksums kept with data, not read")
    frame, first, many = fetch(slots)
    start = mine
    for p in pending:
        end = start + len(p.slots.at)
        p.fill(frame[start:end], first[start:end])
        start = end
    _fill(asked, slots.table[:mine], rows[:mine], (frame, first, many))


def _fill(
    asked: list[tuple[ChunkTable, np.ndarray]],
    owners: np.ndarray,
    rows: np.ndarray,
    fetched: Fetched,
) -> None:
    """What was fetched for the tables' rows (the first `len(owners)` slots) into them."""
    frame, first, many = fetched
    order = np.argsort(owners, kind="stable")
    bounds = np.searchsorted(owners[order], np.arange(len(asked) + 1)).tolist()
    lists: dict[int, dict[int, np.ndarray]] = {}
    for j, crcs in many.items():
        if j < len(owners):
            lists.setdefault(int(owners[j]), {})[int(rows[j])] = crcs
    for n, (table, _wanted) in enumerate(asked):
        mine = order[bounds[n] : bounds[n + 1]]
        if len(mine):
            table.fill(rows[mine], frame[mine], first[mine], lists.get(n, {}))


def _files(named: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct (rank, k, token) of `named`, and which each row names: one save's
    rows share a token, so (rank, k) alone sort them (`np.unique` by rows is slower)."""
    if len(named) and (named[:, 2] == named[0, 2]).all() and named[:, :2].max() < 1 << 31:
        keys, which = np.unique(named[:, 0] << 31 | named[:, 1], return_inverse=True)
        files = np.stack([keys >> 31, keys & ((1 << 31) - 1), np.full_like(keys, named[0, 2])], 1)
        return files, which
    return np.unique(named, axis=0, return_inverse=True)


def _decode(
    data: bytes,
    offsets: np.ndarray,
    count: np.ndarray,
    slots: np.ndarray,
    out: tuple[np.ndarray, np.ndarray, dict[int, np.ndarray]],
) -> None:
    """The slots at `offsets` of `data` (a run read at once) into `out`."""
    frame, first, many = out
    if (offsets % 4 == 0).all():  # the writer's blocks: one slot after the other
        words = np.frombuffer(data, dtype="<u4", count=len(data) // 4)
        frame[slots], first[slots] = words[offsets // 4], words[offsets // 4 + 1]
        for j in np.flatnonzero(count > 1).tolist():
            at = int(offsets[j]) // 4 + 1
            many[int(slots[j])] = words[at : at + int(count[j])]
        return
    for j, (at, n) in enumerate(zip(offsets.tolist(), count.tolist())):  # crafted: as they lie
        slot = np.frombuffer(data, dtype="<u4", count=1 + n, offset=at)
        frame[slots[j]], first[slots[j]] = slot[0], slot[1]
        if n > 1:
            many[int(slots[j])] = slot[1:]


def _runs(
    folder: Folder,
    listing: dict[str, int],
    index: str,
    name: str,
    spans: tuple[np.ndarray, np.ndarray, np.ndarray],
    slots: Slots,
) -> list[tuple[int, int]]:
    """The slots of data file `name` (sorted: positions, starts, ends), checked —
    inside a listed plain data file, not the index, none overlapping the one before —
    as runs of positions read together."""
    mine, at, stop = spans
    size = listing.get(name)
    if size is None or name == index:
        what = "the index" if name == index else "missing or not a plain file"
        raise CorruptCheckpointError(
            f"{slots.names[slots.table[mine[0]]]}: data file {folder.where(name)} is {what} "
            "(it keeps chunk checksums)"
        )
    bad = np.flatnonzero((stop > size) | (at < np.concatenate([[-1], stop[:-1]])))
    if len(bad):
        j = int(bad[0])
        raise CorruptCheckpointError(
            f"{slots.names[slots.table[mine[j]]]}: chunk checksums at bytes {at[j]}..{stop[j]} "
            f"of data file {folder.where(name)} ({size} bytes) "
            + ("lie past its end" if stop[j] > size else "overlap another chunk's")
        )
    cuts = np.flatnonzero(at[1:] - stop[:-1] >= GAP) + 1
    edges = [0, *cuts.tolist(), len(at)]
    return list(zip(edges[:-1], edges[1:]))
