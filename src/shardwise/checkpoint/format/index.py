"""The index of a version 4 and 5 checkpoint: its tensors' chunk sections and the
checksums their writers keep, written and read within bounds.

A load reads only the sections of the tensors it wants, window by window, each
checked before use (every row's and file's byte ranges are in bounds before a
byte is read); version 5 rows keep their checksums in their writers' data
files, fetched for the rows a reader takes.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import crc32c
import numpy as np

from ...errors import CorruptCheckpointError
from ...storage import Folder
from .checks import (
    DATA_FILE,
    check_coverage,
    check_name,
    check_ranges,
    chunk_consistent,
    record_limit,
)
from .entries import VERSION, ChunkEntry, IndexRef, TensorEntry, dtype_from_name
from .table import ChunkTable, Fetch, Slots, encode_section, fetchable, file_of, row_columns

__all__ = [
    "GAP",
    "Pending",
    "Ranges",
    "RowSpans",
    "SlotFetch",
    "TensorChunks",
    "Unsettled",
    "WINDOW",
    "check_read_ranges",
    "fetch_slots",
    "fetcher",
    "read_sections",
    "resolve_rows",
    "resolve_sections",
    "section_bytes",
    "settle",
    "settle_ranges",
    "slot_ranges",
    "write_sections",
]


# -----------------------------------------------------------------------------
# The sections a load reads from a version 4 index, as checked bytes, window by window.
#
# A load of 100,000 small tensors reads 100,000 sections. Where each lies is kept
# as a few int64 columns (not a tuple of Python integers a section: 13 MiB), and
# the windows of adjacent sections are read into one buffer reused for the whole
# load (a fresh 8 MiB `bytes` a window left that much of the heap behind each
# time); each section is copied out of it, its checksum checked.
# -----------------------------------------------------------------------------

WINDOW = 8 << 20  # bytes of adjacent sections read at once

_HUGE = 1 << 61  # past any file: larger stored values are cut to it, sums of three stay exact


def section_bytes(
    folder: Folder,
    index: IndexRef,
    keys: Sequence[str],
    tensors: Mapping[str, TensorEntry],
    source: str,
    listing: dict[str, int],
) -> Iterator[tuple[str, TensorEntry, bytes, str]]:
    """The sections of `tensors[key]` for `keys` as bytes matching their checksums, in
    index order, and each one's name in errors: adjacent sections read together, a
    window of at most `WINDOW` bytes (or one section) at a time."""
    check_name(folder, "index", index.file, source, shardwise=True)
    where = folder.where(index.file)
    heads = [tensors[key].section for key in keys]
    assert None not in heads
    try:
        table = np.asarray(heads, dtype=np.int64).reshape(-1, 5)
    except OverflowError:  # crafted: past any file
        table = np.asarray([[min(v, _HUGE) for v in h] for h in heads], dtype=np.int64)  # type: ignore[union-attr]
    del heads
    table = np.minimum(table, _HUGE)
    block = table[:, 0]
    bad = np.flatnonzero(block >= len(index.blocks))
    if len(bad):
        key = keys[int(bad[0])]
        raise CorruptCheckpointError(
            f"{source}: '{key}' names block {tensors[key].section[0]} of its index"  # type: ignore[index]
        )
    blocks = np.minimum(np.asarray([min(b, _HUGE) for b in index.blocks], dtype=np.int64), _HUGE)
    start = blocks[block] + table[:, 1]
    order = np.argsort(start, kind="stable")
    start, length, crc = start[order], table[order, 2], table[order, 4]
    del table, block
    end = start + length
    # no two sections share bytes (no writer makes them so): many keys naming one section
    # would each hold a copy of it before any row is checked
    solid = np.flatnonzero(length > 0)
    clash = np.flatnonzero(start[solid][1:] < end[solid][:-1])
    if len(clash):
        a, b = (keys[int(order[solid[i]])] for i in (clash[0], clash[0] + 1))
        raise CorruptCheckpointError(
            f"{source}: the sections of '{a}' and '{b}' overlap in {where}: damaged or crafted"
        )
    size = listing.get(index.file)  # plain files only: never a link or a folder
    if size is None:
        raise CorruptCheckpointError(
            f"{source}: index file {where} is missing or not a plain file "
            "(links and folders are refused)"
        )
    limit = record_limit(listing, index.file)  # what one window may cost (`record_limit`)
    file = folder.open(index.file)
    buffer = bytearray()
    try:
        i = 0
        while i < len(order):
            j = _window(start, end, i)
            first, last = int(start[i]), int(end[i:j].max())
            if last > size:
                raise CorruptCheckpointError(
                    f"{source}: sections up to byte {last} of {where} ({size} bytes): truncated"
                )
            if last - first > limit:  # past `WINDOW`: the window is its first section alone
                raise CorruptCheckpointError(
                    f"{source}: the section of '{keys[int(order[i])]}' claims {last - first} "
                    f"bytes of {where}, more than the {limit} a record of this folder may "
                    "hold (damaged or crafted: refused, nothing read)"
                )
            if len(buffer) < last - first:
                buffer = bytearray(last - first)
            got = file.readinto([memoryview(buffer)[: last - first]], first) if last > first else 0
            window = memoryview(buffer)[:got]  # short: what lies past it fails its checksum
            spans = zip(start[i:j].tolist(), length[i:j].tolist(), crc[i:j].tolist())
            for (at, n, expected), which in zip(spans, order[i:j].tolist()):
                data = bytes(window[at - first : at - first + n])
                key = keys[which]
                if crc32c.crc32c(data) != expected:
                    raise CorruptCheckpointError(
                        f"{where}: the section of '{key}' does not match its checksum (damaged)"
                    )
                yield key, tensors[key], data, f"{where} '{key}'"
            window.release()
            i = j
    finally:
        file.close()


def _window(start: np.ndarray, end: np.ndarray, i: int) -> int:
    """Where the window from section `i` (sorted by start) ends: before the first later
    section ending more than `WINDOW` bytes past its start (found in doubling steps:
    linear in the window's sections, however many follow)."""
    limit, step = int(start[i]) + WINDOW, 64
    while True:
        over = np.flatnonzero(end[i + 1 : i + 1 + step] > limit)
        if len(over):
            return i + 1 + int(over[0])
        if i + 1 + step >= len(end):
            return len(end)
        step *= 2


# -----------------------------------------------------------------------------
# What a load of a version 4 index reads, checked before any byte is: every row's and
# object's byte range inside its data file, none in the index file, no two overlapping.
#
# Rows found one at a time land in `Ranges` (a dict); rows found as arrays — a
# reshard's parts (`format.table`), a load's whole chunks (`engine.stored`) — in
# `RowSpans`, one array per batch, checked with a few numpy passes over all of
# them (a dict entry per row costs about 170 bytes: 17 MiB at 100,000 rows).
# -----------------------------------------------------------------------------

# what a load reads, by tensor key and row (an object: row -1), as (key, file, offset, length)
Ranges = dict[tuple[str, int], tuple[str, str, int, int]]


class RowSpans:
    """The byte ranges of rows a load found as arrays (`format.table`, `engine.stored`): arrays
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


# -----------------------------------------------------------------------------
# Checksums kept by their writers (format version 5), fetched for the rows a reader takes.
#
# A collective save's writer puts each chunk's frame and tile checksums in its own
# data file, after its records (`engine.save`): the index rows then follow
# from the plan alone, so a repeated save of one structure routes no checksums to
# the keys' owners and exchanges a few bytes per rank (`engine.save`). A reader
# fetches them only for the rows it takes, per data file, the wanted slots in runs
# (slots less than `GAP` apart read together): a rank loading its own 1,000 chunks
# reads one run of 8 KB of its writer's file, a rank loading a column of every
# writer's chunks one run per writer. Nothing is read before its range is checked:
# inside a plain data file of the listing (never the index), no two slots
# overlapping, so what is read is bounded by the files' real sizes.
# -----------------------------------------------------------------------------

GAP = 4096  # bytes between two wanted slots of a file below which both are one read

# what a fetch gives: each slot's frame and first checksum, all of those with more
Fetched = tuple[np.ndarray, np.ndarray, dict[int, np.ndarray]]


class SlotFetch:
    """The fetch of the tables a reader decodes from `folder`'s index file `index`
    (`format.table.Fetch`); `ranges`: the byte ranges a fetch of those slots reads,
    checked, so that a reader can fetch them with the data they check."""

    def __init__(self, folder: Folder, listing: dict[str, int], index: str) -> None:
        self.folder, self.listing, self.index = folder, listing, index

    def __call__(self, slots: Slots) -> Fetched:
        return fetch_slots(self.folder, self.listing, self.index, slots)

    def ranges(self, slots: Slots) -> dict[str, list[tuple[int, int]]]:
        out: dict[str, list[tuple[int, int]]] = {}
        for name, _mine, at, stop, runs in _by_file(self.folder, self.listing, self.index, slots):
            out[name] = [(int(at[lo]), int(stop[hi - 1])) for lo, hi in runs]
        return out


def fetcher(folder: Folder, listing: dict[str, int], index: str) -> SlotFetch:
    """The fetch of the tables a reader decodes from `folder`'s index file `index`."""
    return SlotFetch(folder, listing, index)


def _by_file(
    folder: Folder, listing: dict[str, int], index: str, slots: Slots
) -> Iterator[tuple[str, np.ndarray, np.ndarray, np.ndarray, list[tuple[int, int]]]]:
    """For each data file the slots name: its name, its slots (positions in `slots`)
    with their starts and ends, sorted, and the runs of them read together, each
    file's slots checked before it is yielded (`_runs`)."""
    files, which = _files(slots.files)
    order = np.lexsort((slots.at, which.reshape(-1)))
    bounds = np.searchsorted(which.reshape(-1)[order], np.arange(len(files) + 1))
    for f, (rank, k, token) in enumerate(files.tolist()):
        mine = order[bounds[f] : bounds[f + 1]]
        name = file_of(rank, k, token)
        at = slots.at[mine]
        count = np.minimum(slots.count[mine], 1 << 58)  # past any file: `stop` cannot wrap
        stop = at + 4 * (1 + count)
        yield name, mine, at, stop, _runs(folder, listing, index, name, (mine, at, stop), slots)


def fetch_slots(folder: Folder, listing: dict[str, int], index: str, slots: Slots) -> Fetched:
    """Each slot's frame and checksums, read file by file in runs of neighbours, each
    file's slots checked first (`_runs`)."""
    n = len(slots.at)
    frame, first = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.uint32)
    many: dict[int, np.ndarray] = {}
    for name, mine, at, stop, runs in _by_file(folder, listing, index, slots):
        count = (stop - at) // 4 - 1
        handle = None
        try:
            for lo, hi in runs:
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


@dataclass
class _Gathered:
    """The slots of a `resolve_rows` call: the tables' rows' first (`mine` of them, of
    `asked[slots.table]`'s rows `rows`), then the pending ones."""

    slots: Slots
    asked: list[tuple[ChunkTable, np.ndarray]]
    rows: np.ndarray
    mine: int
    fetch: Fetch | None


def resolve_rows(
    pairs: Sequence[tuple[ChunkTable, Sequence[int]]],
    pending: Sequence[Pending] = (),
    fetch: Fetch | None = None,
) -> None:
    """Fetch, in one pass over the files, the checksums of every table's rows whose
    writers keep them (`ChunkTable.resolve` for many tables), and the `pending` slots
    (with `fetch`, where no table is asked): which can be fetched is one numpy pass per
    ndim over all of them (`format.table.fetchable`); every slot is checked with all
    the others before its file is read (`fetch_slots`)."""
    found = _gather(pairs, pending, fetch)
    if found is None:
        return
    slots, asked, mine = found.slots, found.asked, found.mine
    if found.fetch is None:  # a reader's bug: a version 5 section read without its files
        raise CorruptCheckpointError(f"{slots.names[0]}: checksums kept with data, not read")
    frame, first, many = found.fetch(slots)
    start = mine
    for p in pending:
        end = start + len(p.slots.at)
        p.fill(frame[start:end], first[start:end])
        start = end
    _fill(asked, slots.table[:mine], found.rows[:mine], (frame, first, many))


def slot_ranges(
    pairs: Sequence[tuple[ChunkTable, Sequence[int]]],
) -> dict[str, list[tuple[int, int]]]:
    """The byte ranges of data files `resolve_rows(pairs)` would read, checked as it
    checks them: what a reader fetches with the data they check (`io.read`)."""
    found = _gather(pairs, (), None)
    if found is None or not isinstance(found.fetch, SlotFetch):
        return {}
    return found.fetch.ranges(found.slots)


def _gather(
    pairs: Sequence[tuple[ChunkTable, Sequence[int]]],
    pending: Sequence[Pending],
    fetch: Fetch | None,
) -> _Gathered | None:
    """The slots `resolve_rows` fetches; None: there are none."""
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
        col = row_columns(ndim)
        file = slice(col.rank, col.token + 1)  # rank k token: the data file's name
        parts.append(
            (cols[take, file], at[take], cols[take, col.crc_count], owner[take], taken[take])
        )
    names = [t.where for t, _r in asked]
    mine = sum(len(p[1]) for p in parts)  # the tables' slots, first
    for p in pending:
        s = p.slots
        parts.append((s.files, s.at, s.count, s.table + len(names), np.zeros_like(s.at)))
        names += s.names
    if not parts:
        return None
    files, at, count, owners, rows = (np.concatenate(column) for column in zip(*parts))
    slots = Slots(files.reshape(-1, 3), at, count, owners, names)
    if not len(slots.at):
        return None
    if asked:
        first_table, _rows = asked[0]
        fetch = first_table.fetch
    return _Gathered(slots, asked, rows, mine, fetch)


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


# -----------------------------------------------------------------------------
# The index of a version 4 checkpoint: its tensors' chunk sections, written and read.
#
# A save writes every tensor's section (`format.table`) into one data file of its
# own, the index, block by block (one block per writer of sections: each owner of
# keys in a collective save, `engine.records`), and the manifest points at each
# section. Readers take what they need from it:
#
# - a load (`StoredView`) reads the sections of the tensors it loads, in windows
#   of adjacent sections (one read per window, never the whole index at once), and
#   decodes only the rows that overlap its pieces (`TensorChunks`): for each piece
#   the rows it reads are checked as a manifest's chunks are — in bounds,
#   consistent sizes and checksums, covering the piece exactly once — and the byte
#   ranges of all the rows it reads lie inside their data files, no two
#   overlapping (`check_read_ranges`);
# - tools (`Manifest.read`) resolve every section into the entries a version 3
#   manifest lists, then check them all together.
# -----------------------------------------------------------------------------


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
    folder: Folder,
    index: IndexRef,
    tensors: dict[str, TensorEntry],
    source: str,
    version: int,
    settled: bool = True,
) -> dict[tuple[str, tuple[int, ...]], Unsettled]:
    """Every tensor's chunk entries, from its section (for tools: `Manifest.read`): the
    checksums their writers keep fetched for all sections at once; or, not `settled`,
    none fetched (where each lies checked, as a load's planning checks them) and each
    such chunk returned (by key and offsets) as `Unsettled`, for the rank that reads it
    to fetch them with its bytes (`dcp.Reader`: every rank reads all sections)."""
    tables = list(read_sections(folder, index, list(tensors.items()), source, version=version))
    if settled:
        resolve_rows([(table, range(len(table))) for _key, table in tables])
        for key, table in tables:
            tensors[key].chunks = table.entries()
        return {}
    slot_ranges([(table, range(len(table))) for _key, table in tables])  # checked, not read
    out: dict[tuple[str, tuple[int, ...]], Unsettled] = {}
    for key, table in tables:
        t = tensors[key]
        itemsize = dtype_from_name(t.dtype).itemsize
        t.chunks = [table.entry(i, fetch=False) for i in range(table.count)]
        for i, c in enumerate(t.chunks):
            if c.crc_at >= 0:
                out[(key, tuple(c.offsets))] = _unsettled(table, i, c, tuple(t.shape), itemsize)
    return out


def _unsettled(
    table: ChunkTable, row: int, c: ChunkEntry, shape: tuple[int, ...], itemsize: int
) -> Unsettled:
    """Row `row`'s entry `c` of a tensor of `shape`, its kept checksums not fetched."""
    assert table.fetch is not None and c.crc_at >= 0  # a version 5 section's kept row
    return Unsettled(
        c,
        table.file_key(row),
        c.crc_at,
        table.crc_count(row),
        table.where,
        shape,
        itemsize,
        table.fetch,
    )


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
        self,
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
        rows: list[int] | None = None,
        fetch: bool = True,
    ) -> list[ChunkEntry]:
        """The stored chunks overlapping the non-empty box (`offsets`, `sizes`): `rows`,
        when the caller found them (`ChunkTable.overlapping`). `fetch=False`: checksums
        their writers keep are not fetched (`ChunkTable.entry`; `settle` does, for the
        rank that reads them); everything else is checked as ever."""
        if rows is None:
            rows = self.table.overlapping(offsets, sizes)
        found = [self.table.entry(i, fetch) for i in rows]
        for i, c in zip(rows, found):
            self.check(c, i)
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
            check_coverage(
                f"{self.key} (at {offsets})", sizes, clipped, self.table.where, replicas=False
            )
        return found

    def unsettled(self, row: int, c: ChunkEntry) -> Unsettled:
        """Row `row`'s entry `c`, its checksums not fetched (`covering(fetch=False)`)."""
        return _unsettled(self.table, row, c, tuple(self.entry.shape), self.itemsize)

    def check(self, c: ChunkEntry, row: int) -> None:
        """Row `row`'s entry `c` as `_check_entry` checks it (checksums not fetched yet:
        their count in the row)."""
        counted = c if c.crc_at < 0 else replace(c, crcs=range(self.table.crc_count(row)))  # type: ignore[arg-type]
        _check_entry(counted, self.entry.shape, self.itemsize, self.table.where)


def _check_entry(c: ChunkEntry, shape: Sequence[int], itemsize: int, where: str) -> None:
    """`c` inside a tensor of `shape`, its sizes, byte ranges and checksums consistent."""
    if not (
        all(map(operator.le, map(operator.add, c.offsets, c.sizes), shape))
        and chunk_consistent(c, itemsize, 4, 0)
    ):
        raise CorruptCheckpointError(
            f"{where}: chunk at offsets {c.offsets} has inconsistent sizes or byte ranges "
            f"(file {c.file}, payload {c.payload})"
        )


@dataclass(frozen=True, eq=False)
class Unsettled:
    """A stored chunk planned without the checksums its writer keeps
    (`TensorChunks.unsettled`): a rank that plans with a chunk another rank reads
    never fetches them; the one that reads it does (`settle`), in the same requests
    as its bytes on an object store (`io.read`). Every planning rank has checked
    where they lie (`stored.fetched`); this keeps only what fetching them needs, not
    its section (a load holds these for all its rounds)."""

    entry: ChunkEntry  # checked, but for its checksums
    file: tuple[int, int, int]  # its writer's data file: rank, k, token
    at: int  # where its frame and checksums start there
    count: int  # how many checksums follow the frame
    where: str  # its section, in errors
    shape: tuple[int, ...]  # its tensor's
    itemsize: int
    fetch: Fetch


def _slots(unsettled: Sequence[Unsettled]) -> list[tuple[Fetch, list[list[int]], Slots]]:
    """The distinct slots of `unsettled` by fetch (one per index), and for each slot the
    positions in `unsettled` of the chunks it holds the checksums of (a chunk two pieces
    of one rank overlap is planned twice: its slot is one, fetched once)."""
    by_fetch: dict[int, tuple[Fetch, dict[tuple[Any, ...], list[int]]]] = {}
    for j, u in enumerate(unsettled):
        seen = by_fetch.setdefault(id(u.fetch), (u.fetch, {}))[1]
        seen.setdefault((u.file, u.at, u.count), []).append(j)
    out = []
    for fetch, seen in by_fetch.values():
        keys = list(seen)
        slots = Slots(
            np.asarray([f for f, _a, _c in keys], dtype=np.int64).reshape(-1, 3),
            np.asarray([a for _f, a, _c in keys], dtype=np.int64),
            np.asarray([c for _f, _a, c in keys], dtype=np.int64),
            np.arange(len(keys)),
            [unsettled[seen[k][0]].where for k in keys],
        )
        out.append((fetch, [seen[k] for k in keys], slots))
    return out


def settle(unsettled: Sequence[Unsettled]) -> list[ChunkEntry]:
    """Each chunk's entry with its checksums, fetched for all at once (a read per data
    file and run: `fetch_slots`, each slot checked first) and checked as
    `TensorChunks.check` checks an entry (`_check_entry`)."""
    out: list[ChunkEntry | None] = [None] * len(unsettled)
    for fetch, holders, slots in _slots(unsettled):
        frame, first, many = fetch(slots)
        for i, js in enumerate(holders):
            for j in js:
                u = unsettled[j]
                crcs = many[i].tolist() if i in many else [int(first[i])] if u.count else []
                c = replace(u.entry, crcs=crcs, frame=int(frame[i]), crc_at=-1)
                _check_entry(c, u.shape, u.itemsize, u.where)
                out[j] = c
    return out  # type: ignore[return-value]


def settle_ranges(unsettled: Sequence[Unsettled]) -> dict[str, list[tuple[int, int]]]:
    """The byte ranges `settle(unsettled)` reads, checked: inside their data files."""
    out: dict[str, list[tuple[int, int]]] = {}
    for fetch, _holders, slots in _slots(unsettled):
        if isinstance(fetch, SlotFetch):
            for name, ranges in fetch.ranges(slots).items():
                out.setdefault(name, []).extend(ranges)
    return out
