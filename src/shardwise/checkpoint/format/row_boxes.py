"""The parts of a piece in small stored chunks, from a version 4 section, as arrays.

A reshard reads parts of many chunks per piece: a column band of every row
chunk of a tensor (1,000 tensors of 32 row chunks loaded by columns: 32,000
parts on each rank). One entry, one storage info and one read request per part
(`TensorChunks.covering`) cost about 80 µs a part; here the rows overlapping a
piece are checked together with numpy, by the same rules — in bounds, byte
ranges consistent with the sizes, one checksum tile, the rows covering the
piece exactly once — and handed on as arrays (`Boxes`) that the read executor
gathers (`io.part_gather`), a few µs a part. Only plain one-tile chunks take
this path (a part of one reads its whole payload to verify it anyway); for any
other row, or anything wrong, `one_tile_boxes` returns None and the caller
takes `covering`, whose checks name the problem.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .byte_runs import MERGE_GAP
from .chunk_coverage import check_coverage

if TYPE_CHECKING:
    from .manifest_index import TensorChunks

__all__ = ["Boxes", "dense", "one_tile_boxes", "plain", "plain_rows", "row_strides"]

_BYTES_LIMIT = float(1 << 62)  # bytes no chunk reaches: its int64 arithmetic stays exact
_NON_NEGATIVE = [0, 1, 3, 4, 7]  # rank, k, record offset and length, frame
_BOUNDED = [2, 7]  # token (48 bits), frame (a crc32c)
_BOUNDS = ((1 << 48) - 1, 0xFFFFFFFF)


@dataclass
class Boxes:
    """Parts of `k` stored chunks of one tensor: row `i` is the box at `inner[i]` of
    `lengths[i]` of its chunk (of `sizes[i]`), going to `dest[i]` of the piece. The
    chunk's payload is bytes `payload[i]` (offset, length) of its record `record[i]` in
    the data file named by `file[i]` (rank, k, token: `chunk_table.file_of`), its one
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
    at, size = rows[:, :d], rows[:, d : 2 * d]
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
    c = 3 * d  # rank k token record_offset record_length payload_offset payload_length
    chunks.spans.add(chunks.key, hit, rows[:, c : c + 5])
    return Boxes(
        rows[:, c : c + 3],
        rows[:, c + 3 : c + 5],
        rows[:, c + 5 : c + 7],
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
    ranged read of its runs would (`byte_runs.spans`: runs closer than `MERGE_GAP` are
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
    d = (array.shape[1] - 10) // 3
    at, size, tile = array[:, :d], array[:, d : 2 * d], array[:, 2 * d : 3 * d]
    # rank k token record_offset record_length payload_offset payload_length frame count transform
    cols = array[:, 3 * d :]
    rec_off, rec_len, pay_off, pay_len = cols[:, 3], cols[:, 4], cols[:, 5], cols[:, 6]
    inside = (at + size <= shape).all(axis=1)
    ok = (
        inside
        & (tile == size).all(axis=1)
        & (cols[:, _NON_NEGATIVE] >= 0).all(axis=1)
        & (cols[:, _BOUNDED] <= _BOUNDS).all(axis=1)
        & (cols[:, 8:] == (1, -1)).all(axis=1)  # one checksum, no transform
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
