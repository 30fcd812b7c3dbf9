"""Pieces that are whole stored chunks, planned as arrays a group of sections at a time.

The common load — each piece of a target exactly one stored chunk (a rank loading
what it saved) — made one `ChunkTable`, one `ChunkEntry`, one `StoredChunk` and
one `ChunkRead` per piece before reading any, and a dict entry per byte range:
about 4 KB and 100 µs a piece, 100,000 small tensors costing 200 MiB and 10 s
a rank. Here the sections of a group are decoded together (`section_rows`) and
each piece checked against its section's rows by numpy passes over the group:
exactly one row overlaps it and that row's box is the piece's (so it is covered
exactly once), the row is a plain one-tile chunk in bounds with consistent byte
ranges (`row_boxes.plain`), the checksums its writer keeps fetchable and fetched
with the other rows' (`writer_checksums.Pending`), its byte range added to the load's as
arrays (`RowSpans`, checked before any read). A section any of whose pieces
fails any of that is handed back, and planned alone as before (`ChunkTable`,
`TensorChunks.covering`), which names what is wrong: nothing is accepted here
that the one-piece path would refuse. What was accepted stays as a few columns a
piece, turned into read requests `BATCH` pieces at a time, once every range of
the load is checked (`reads`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ..format.chunk_table import Fetch, file_of
from ..format.kept_checksums import Slots, fetchable
from ..format.manifest import StoredChunk
from ..format.manifest_entries import TensorEntry, dtype_from_name
from ..format.manifest_index import RowSpans
from ..format.row_boxes import plain
from ..format.section_rows import Rows, decode
from ..format.writer_checksums import Pending, resolve_rows
from ..io.read_requests import ChunkRead
from .inventory import Piece

__all__ = ["BATCH", "Section", "WholeRows"]

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
    but not read, another rank sends them), taken group by group (`take`)."""

    def __init__(
        self,
        held: dict[str, list[Piece]],
        sent: set[str],
        version: int,
        spans: RowSpans,
        fetch: Fetch,
    ) -> None:
        self.held, self.sent, self.version = held, sent, version
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
            (by_ndim.setdefault(ndim, []) if ndim else rest).append(s)
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
        c = rows.columns
        crc = rows.first[r]
        kept = np.flatnonzero(rows.crc_at[r] >= 0)
        if len(kept):
            wanted, back = np.unique(r[kept], return_inverse=True)
            slots = Slots(
                c[wanted, 3 * d : 3 * d + 3],
                rows.crc_at[wanted],
                c[wanted, -2],
                rows.sec[wanted],
                [name for _k, _t, _b, name in part],
            )
            self.pending.append(Pending(slots, _filler(crc, kept, back)))
            self.slots += len(wanted)
            if self.slots >= SLOTS:  # fetched now, not kept until the next group of rows
                resolve_rows([], self.fetching(), self.fetch)
        keys = [key for key, _t, _b, _n in part]
        self.spans.add_many(keys, sec, r - rows.start[sec], c[r, 3 * d : 3 * d + 5])
        self.taken += len(sec)
        read = np.flatnonzero(~np.asarray([key in self.sent for key in keys], dtype=bool)[sec])
        if len(read):
            cols = np.hstack([c[r[read], 3 * d : 3 * d + 7], n[read]])
            picked = [tensors[i] for i in read.tolist()]
            dtypes = [t.dtype for _k, t, _b, _n in part]
            self.wholes.append(_Wholes(keys, dtypes, sec[read], picked, cols, crc, read))

    def fetching(self) -> list[Pending]:
        """The checksum slots of the rows taken since last asked, to fetch with the rows
        found one at a time (`overlaps.fetched`): one read per data file and group."""
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
    at, size = rows.columns[row, :d], rows.columns[row, d : 2 * d]
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
