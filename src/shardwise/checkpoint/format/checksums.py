"""Checksums: the byte-level rules every writer, reader and verifier shares.

Raw writes and page checksums; tiled checksums (one crc32c per tile of a
chunk, so a ranged read verifies only what it reads), computed over a payload
that arrives in pieces; and which byte ranges of a C-order chunk a sub-box
covers (pure math, so ranged reads and their checksums are testable).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import crc32c
import torch

from ...errors import InvalidArgumentError, LayoutError
from .entries import PAGE_SIZE

__all__ = [
    "BadTile",
    "MERGE_GAP",
    "RUN_BYTES",
    "SMALL",
    "TILE_BYTES",
    "TileHasher",
    "bad_page",
    "bad_tile",
    "bad_tile_in_box",
    "byte_view",
    "c_strides",
    "checksum_payload",
    "enclosing_box",
    "few_runs",
    "frame_crc",
    "grid_shape",
    "list_spans",
    "nbytes",
    "pages_of",
    "payload_tiles",
    "runs",
    "spans",
    "tile_count",
    "tile_crcs",
    "tile_lengths",
    "tile_shape",
    "valid_tile",
]


# -----------------------------------------------------------------------------
# Raw writes and page checksums: the byte-level rules every writer, reader and verifier shares.
#
# One definition each, so what a writer checksums is exactly what a reader checks.
# Pages of `PAGE_SIZE` are the checksums of format versions 1 and 2, still read and
# verified; version 3 checksums tiles (`format.checksums`).
# -----------------------------------------------------------------------------


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, in C order, without a copy (through numpy's
    buffer where the dtype has one: a third of the cost, which counts at 100,000 tensors)."""
    if t.dtype in _NUMPY_DTYPES and t.numel():
        return t.numpy().data.cast("B")
    return t.reshape(-1).view(torch.uint8).numpy().data


_NUMPY_DTYPES = {
    torch.float64,
    torch.float32,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
}


def pages_of(payload: memoryview, page_size: int = PAGE_SIZE) -> list[int]:
    """crc32c of each `page_size` slice of a payload; an empty payload is one empty page."""
    if len(payload) == 0:
        return [crc32c.crc32c(b"")]
    return [crc32c.crc32c(payload[i : i + page_size]) for i in range(0, len(payload), page_size)]


def frame_crc(head: bytes | memoryview, tail: bytes | memoryview) -> int:
    """crc32c of a record's bytes around its payload, as one stream."""
    return crc32c.crc32c(tail, crc32c.crc32c(head))


def bad_page(data: memoryview | bytes, start: int, page: int, pages: list[int]) -> int | None:
    """Offset in `data` of its first page that fails its checksum, else None; `data`
    holds whole pages (the last may be short) from the page-aligned payload offset `start`."""
    for k in range(0, max(len(data), 1), page):  # empty: the one empty page `pages_of` sums
        if crc32c.crc32c(data[k : k + page]) != pages[(start + k) // page]:
            return k
    return None


# -----------------------------------------------------------------------------
# Which byte ranges of a C-order chunk a sub-box covers: pure math, so ranged reads are testable.
#
# A sub-box of a C-contiguous array is a set of equal runs of bytes along its
# last partial dimension; `runs` finds them, and `spans` groups them into the
# reads a reader makes. No I/O here: `Reader` moves the bytes.
# -----------------------------------------------------------------------------

MERGE_GAP = 4096  # runs closer than one OS page are read together: a smaller gap saves no I/O

# up to this many runs, plain lists beat tensors: a reshard's part reads are often a few
# rows of a column band, where a dozen tensor ops cost more than the read itself
SMALL = 64


def c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a C-order array of `shape`."""
    return tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a C-order array: the one size rule for chunks, tensors and files."""
    return math.prod(shape) * dtype.itemsize


def _folded(shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...]) -> int:
    """The last dimension a run does not span whole: the trailing dimensions a box
    spans whole fold into one run."""
    k = len(shape) - 1
    while k > 0 and lengths[k] == shape[k] and offsets[k] == 0:
        k -= 1
    return k


def few_runs(
    shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...], itemsize: int
) -> tuple[list[int], int] | None:
    """`runs` as a list when there are at most `SMALL` runs, else None."""
    ndim = len(shape)
    if ndim == 0:
        return [0], itemsize
    if math.prod(lengths) == 0:
        return [], 0
    k = _folded(shape, offsets, lengths)
    if math.prod(lengths[:k]) > SMALL:
        return None
    strides = c_strides(shape)
    starts = [offsets[k] * strides[k]]
    for d in reversed(range(k)):  # outer dimensions vary slowest
        steps = [i * strides[d] for i in range(offsets[d], offsets[d] + lengths[d])]
        starts = [step + start for step in steps for start in starts]
    return [start * itemsize for start in starts], lengths[k] * strides[k] * itemsize


def list_spans(
    starts: list[int], run: int, gap: int, page: int | None, limit: int
) -> list[tuple[int, int, int, int]]:
    """`spans` of `few_runs`' list."""
    lo, hi = starts, [s + run for s in starts]
    if page is not None:
        lo = [s // page * page for s in lo]
        hi = [min(-(-e // page) * page, limit) for e in hi]
    bounds = [0, *(i + 1 for i in range(len(lo) - 1) if lo[i + 1] - hi[i] >= gap), len(lo)]
    return [(lo[a], hi[b - 1] - lo[a], a, b) for a, b in zip(bounds, bounds[1:])]


def runs(
    shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...], itemsize: int
) -> tuple[torch.Tensor, int]:
    """`(starts, run_bytes)`: the byte offsets, in C order, of the equal runs that make
    up a sub-box of a C-order array; disjoint, increasing, and no two touching."""
    ndim = len(shape)
    if ndim == 0:
        return torch.zeros(1, dtype=torch.int64), itemsize
    if math.prod(lengths) == 0:
        return torch.zeros(0, dtype=torch.int64), 0
    k = _folded(shape, offsets, lengths)
    strides = c_strides(shape)
    starts = torch.tensor([offsets[k] * strides[k]], dtype=torch.int64)
    for d in reversed(range(k)):  # outer dimensions vary slowest
        steps = torch.arange(offsets[d], offsets[d] + lengths[d], dtype=torch.int64) * strides[d]
        starts = (steps.view(-1, 1) + starts.view(1, -1)).reshape(-1)
    return starts * itemsize, lengths[k] * strides[k] * itemsize


def spans(
    starts: torch.Tensor, run: int, gap: int, page: int | None, limit: int
) -> list[tuple[int, int, int, int]]:
    """Byte spans `(start, length, first run, end run)` to read: runs merged across
    gaps under `gap`, widened to whole `page`s (not past `limit`) when verifying."""
    lo = starts
    hi = starts + run
    if page is not None:
        lo = lo // page * page
        hi = torch.clamp((hi + page - 1) // page * page, max=limit)
    breaks = (lo[1:] - hi[:-1] >= gap).nonzero().flatten() + 1
    bounds = [0, *breaks.tolist(), len(starts)]
    lo_list, hi_list = lo.tolist(), hi.tolist()
    return [(lo_list[a], hi_list[b - 1] - lo_list[a], a, b) for a, b in zip(bounds, bounds[1:])]


# -----------------------------------------------------------------------------
# Tiled checksums: one crc32c per tile of a chunk, so a ranged read verifies only what it reads.
#
# A stored chunk is a C-order array. Its tile grid covers it in C order (edge
# tiles smaller), and each tile has the crc32c of its elements in C order, as if
# the tile were a contiguous array. A sub-box of the chunk is verified by reading
# the tile-aligned box that encloses it and checking the tiles in that box, so a
# column band of a row-wise chunk costs the band widened to whole tiles, not the
# chunk. `tile_shape` picks tiles that are contiguous in the payload (rows longer
# than `RUN_BYTES` are split into `RUN_BYTES` column tiles), so checksumming a
# payload is one crc32c call per tile, in memory order, never a copy.
#
# Pure math and crc32c over buffers that are passed in: no I/O, no process group.
# Format version 3 stores `tile` and `format.checksums` per chunk (docs/format.md).
# -----------------------------------------------------------------------------

TILE_BYTES = 256 * 1024  # at most this many bytes per tile (unless one element is larger)

RUN_BYTES = 64 * 1024  # rows longer than this are split into column tiles of this size

Shape = tuple[int, ...]


def tile_shape(shape: Sequence[int], itemsize: int) -> Shape:
    """The tile shape the writer uses for a chunk of `shape` and `itemsize`.

    A chunk of at most `TILE_BYTES` (or 0-d, or empty) is one tile. Otherwise the
    last dimension gets `RUN_BYTES` of elements (the whole row when shorter); then,
    walking outward, each dimension takes what the `TILE_BYTES` budget leaves, and
    once one dimension is split every outer one gets 1. So every tile is one
    contiguous slab of the payload, and the grid's C order is memory order.
    """
    shape = tuple(shape)
    n = math.prod(shape)
    if not shape or n == 0 or n * itemsize <= TILE_BYTES:
        return shape
    tile = [1] * len(shape)
    tile[-1] = min(shape[-1], max(1, RUN_BYTES // itemsize))
    split, inner = tile[-1] < shape[-1], tile[-1]
    for d in reversed(range(len(shape) - 1)):
        if split:
            break  # outer dimensions stay 1
        tile[d] = min(shape[d], max(1, TILE_BYTES // itemsize // inner))
        split, inner = tile[d] < shape[d], inner * tile[d]
    return tuple(tile)


def grid_shape(shape: Sequence[int], tile: Sequence[int]) -> Shape:
    """Tiles along each dimension. An empty chunk (its tile is its shape) is one tile."""
    return tuple(-(-s // t) if t else 1 for s, t in zip(shape, tile))


def tile_count(shape: Sequence[int], tile: Sequence[int]) -> int:
    return math.prod(grid_shape(shape, tile))


def valid_tile(shape: Sequence[int], tile: Sequence[int] | None) -> bool:
    """A tile shape a chunk of `shape` can have: each side in [1, size], or the whole
    chunk when it is empty."""
    if tile is None or len(tile) != len(shape):
        return False
    if math.prod(shape) == 0:
        return tuple(tile) == tuple(shape)
    return all(1 <= t <= s for s, t in zip(shape, tile))


def enclosing_box(
    shape: Sequence[int], tile: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]
) -> tuple[Shape, Shape]:
    """(offsets, lengths) of the smallest tile-aligned box holding the box
    `offsets`/`lengths` of a chunk of `shape`, clamped to the chunk. An empty box
    stays as it is (nothing is read, nothing verified)."""
    if math.prod(lengths) == 0:
        return tuple(offsets), tuple(lengths)
    lo = tuple(o // t * t for o, t in zip(offsets, tile))
    hi = tuple(min(-(-(o + n) // t) * t, s) for o, n, t, s in zip(offsets, lengths, tile, shape))
    return lo, tuple(b - a for a, b in zip(lo, hi))


@dataclass(frozen=True)
class BadTile:
    """A tile that fails its checksum: its index in the grid's C order and the payload
    bytes that hold it (from its first byte to its last; exact for contiguous tiles)."""

    index: int
    start: int
    end: int


def tile_crcs(
    payload: memoryview | bytes, shape: Sequence[int], itemsize: int, tile: Sequence[int]
) -> list[int]:
    """crc32c of each tile of a whole C-order payload, in the grid's C order."""
    shape, tile = tuple(shape), tuple(tile)
    k = _slab_dim(shape, tile)
    if k is not None and tile != shape:  # tiles back to back: one crc32c call each, no more
        crc = crc32c.crc32c
        inner = math.prod(shape[k + 1 :]) * itemsize
        row, step, total = shape[k] * inner, tile[k] * inner, math.prod(shape) * itemsize
        if row % step == 0:
            return [crc(payload[at : at + step]) for at in range(0, total, step)]
        cuts = range(0, row, step)
        return [
            crc(payload[r + a : r + min(a + step, row)]) for r in range(0, total, row) for a in cuts
        ]
    whole = _tiles(shape, itemsize, tile, (0,) * len(shape), shape)
    return [_crc(payload, spans) for _, spans, _, _ in whole]


def checksum_payload(
    payload: memoryview | bytes, shape: Sequence[int], itemsize: int
) -> tuple[Shape, list[int]]:
    """The writer's side: (tile shape, crc32c of each tile) of a whole C-order payload."""
    if len(payload) <= TILE_BYTES:  # one tile, the whole chunk: the common small case
        return tuple(shape), [crc32c.crc32c(payload)]
    tile = tile_shape(shape, itemsize)
    return tile, tile_crcs(payload, shape, itemsize, tile)


def bad_tile(
    payload: memoryview | bytes,
    shape: Sequence[int],
    itemsize: int,
    tile: Sequence[int],
    crcs: Sequence[int],
) -> BadTile | None:
    """The first tile of a whole payload that fails its checksum, else None."""
    shape = tuple(shape)
    return bad_tile_in_box(payload, shape, itemsize, tile, crcs, (0,) * len(shape), shape)


def bad_tile_in_box(
    data: memoryview | bytes,
    shape: Sequence[int],
    itemsize: int,
    tile: Sequence[int],
    crcs: Sequence[int],
    offsets: Sequence[int],
    lengths: Sequence[int],
) -> BadTile | None:
    """The first tile that fails its checksum among those of the tile-aligned box
    `offsets`/`lengths` (an `enclosing_box`), which `data` holds in C order, else None."""
    shape, tile, offsets, lengths = tuple(shape), tuple(tile), tuple(offsets), tuple(lengths)
    if enclosing_box(shape, tile, offsets, lengths) != (offsets, lengths):
        raise LayoutError(
            f"box {offsets}+{lengths} is not tile-aligned (tile {tile}, chunk {shape})"
        )
    if len(data) != math.prod(lengths) * itemsize:
        raise LayoutError(f"{len(data)} bytes do not hold a box {lengths} of {itemsize}-byte items")
    if 0 in lengths and 0 not in shape:
        return None  # an empty box of a non-empty chunk holds no tile
    for index, spans, start, end in _tiles(shape, itemsize, tile, offsets, lengths):
        if _crc(data, spans) != crcs[index]:
            return BadTile(index, start, end)
    return None


def payload_tiles(
    shape: Sequence[int], itemsize: int, tile: Sequence[int]
) -> Iterator[tuple[int, Sequence[tuple[int, int]]]]:
    """Each tile of a chunk, in the grid's C order: (its index, its runs `(start,
    length)` in the payload). One run each for the tiles `tile_shape` makes, back to
    back: a reader that streams a payload checks them as they come."""
    shape = tuple(shape)
    for index, spans, _, _ in _tiles(shape, itemsize, tuple(tile), (0,) * len(shape), shape):
        yield index, spans


def _crc(data: memoryview | bytes, spans: Sequence[tuple[int, int]]) -> int:
    crc = 0
    for at, n in spans:
        crc = crc32c.crc32c(data[at : at + n], crc)
    return crc


def _tiles(
    shape: Shape, itemsize: int, tile: Shape, offsets: Shape, lengths: Shape
) -> Iterator[tuple[int, Sequence[tuple[int, int]], int, int]]:
    """For each tile of the tile-aligned box `offsets`/`lengths`, in the grid's C order:
    (its index in the whole grid, its runs `(start, length)` in a buffer holding the box
    in C order, its first and end byte in the payload)."""
    nbytes = math.prod(lengths) * itemsize
    if tile == shape:  # one tile (0-d and empty chunks included): the box is the chunk
        yield 0, ((0, nbytes),), 0, nbytes
        return
    k = _slab_dim(shape, tile)
    if k is not None:
        yield from _slab_tiles(shape, itemsize, tile, offsets, lengths, k)
    else:
        yield from _any_tiles(shape, itemsize, tile, offsets, lengths)


def _slab_dim(shape: Shape, tile: Shape) -> int | None:
    """The dimension k of a tile in slab form (the form `tile_shape` makes: 1 outside
    k, whole inside k), else None. Every tile is then contiguous in the payload and
    in any tile-aligned box, and the grid's C order is memory order."""
    if not tile:
        return None
    k = next((d for d, t in enumerate(tile) if t != 1), len(tile) - 1)
    return k if tile[k + 1 :] == shape[k + 1 :] else None


def _slab_tiles(
    shape: Shape, itemsize: int, tile: Shape, offsets: Shape, lengths: Shape, k: int
) -> Iterator[tuple[int, Sequence[tuple[int, int]], int, int]]:
    inner = math.prod(shape[k + 1 :]) * itemsize  # bytes per index of dimension k
    step = tile[k] * inner
    band_lo, band_hi = offsets[k] * inner, (offsets[k] + lengths[k]) * inner
    payload_strides = [s * itemsize for s in c_strides(shape)[:k]]
    grid_strides = c_strides(grid_shape(shape, tile))[: k + 1]
    first = offsets[k] // tile[k] * grid_strides[k]
    at = 0  # in the box buffer: tiles follow each other
    for index in itertools.product(*(range(o, o + n) for o, n in zip(offsets[:k], lengths[:k]))):
        row = sum(i * s for i, s in zip(index, payload_strides))
        g = sum(i * s for i, s in zip(index, grid_strides)) + first
        for lo in range(band_lo, band_hi, step):
            n = min(step, band_hi - lo)
            yield g, ((at, n),), row + lo, row + lo + n
            at += n
            g += 1


def _any_tiles(
    shape: Shape, itemsize: int, tile: Shape, offsets: Shape, lengths: Shape
) -> Iterator[tuple[int, Sequence[tuple[int, int]], int, int]]:
    """Any tile shape (a manifest may name one `tile_shape` would not pick): each tile
    is the runs `format.checksums.runs` finds, computed once per tile size and moved."""
    grid_strides = c_strides(grid_shape(shape, tile))
    box_strides = [s * itemsize for s in c_strides(lengths)]
    payload_strides = [s * itemsize for s in c_strides(shape)]
    # per tile size: its run starts and length in the box, its first and end byte in the
    # payload (runs fold differently there: the box may hold the tile's rows whole)
    cache: dict[Shape, tuple[list[int], int, int, int]] = {}
    ranges = [range(o // t, -(-(o + n) // t)) for o, n, t in zip(offsets, lengths, tile)]
    for g in itertools.product(*ranges):
        origin = [i * t for i, t in zip(g, tile)]
        sizes = tuple(min(t, s - o) for t, s, o in zip(tile, shape, origin))
        if sizes not in cache:
            zero = (0,) * len(shape)
            in_box, run = runs(lengths, zero, sizes, itemsize)
            in_payload, payload_run = runs(shape, zero, sizes, itemsize)
            first, last = int(in_payload[0]), int(in_payload[-1]) + payload_run
            cache[sizes] = (in_box.tolist(), run, first, last)
        box_starts, run, first, last = cache[sizes]
        at = sum((o - b) * s for o, b, s in zip(origin, offsets, box_strides))
        base = sum(o * s for o, s in zip(origin, payload_strides))
        index = sum(i * s for i, s in zip(g, grid_strides))
        yield index, [(at + s, run) for s in box_starts], base + first, base + last


# -----------------------------------------------------------------------------
# Tile checksums of a payload that arrives in pieces: a chunk staged through bounded
# host buffers is checksummed as each buffer lands, never whole in memory at once.
#
# `TileHasher` gives exactly what `format.checksums.checksum_payload` gives for the whole
# payload (the same tile shape, the same crc32c per tile), whatever the piece
# boundaries: the writer's tiles (`format.checksums.tile_shape`) are contiguous and back to
# back in memory order, so their byte lengths are a fixed sequence and a tile cut
# by a piece boundary continues its crc32c in the next piece.
# -----------------------------------------------------------------------------


def tile_lengths(shape: Sequence[int], itemsize: int, tile: Sequence[int]) -> Iterator[int]:
    """The byte length of each tile of a writer-tiled payload, in memory order."""
    shape, tile = tuple(shape), tuple(tile)
    total = math.prod(shape) * itemsize
    if tile == shape:
        yield total
        return
    # `tile_shape`'s form: 1 before dimension k, whole after it (so each tile is contiguous)
    k = next((d for d, t in enumerate(tile) if t != 1), len(tile) - 1)
    inner = math.prod(shape[k + 1 :]) * itemsize
    row, step = shape[k] * inner, tile[k] * inner
    cuts = [min(step, row - a) for a in range(0, row, step)]
    for _ in range(total // row if row else 0):
        yield from cuts


class TileHasher:
    """crc32c per tile of a C-order payload of `shape` fed in consecutive pieces."""

    __slots__ = ("tile", "crcs", "_lengths", "_left", "_crc", "_fed", "_total")

    def __init__(self, shape: Sequence[int], itemsize: int) -> None:
        shape = tuple(shape)
        self._total = math.prod(shape) * itemsize
        self.tile: Shape = (
            shape if self._total <= TILE_BYTES else tile_shape(shape, itemsize)
        )  # as `checksum_payload` picks it
        self.crcs: list[int] = []
        self._lengths = tile_lengths(shape, itemsize, self.tile)
        self._left = next(self._lengths, 0)
        self._crc = 0
        self._fed = 0

    def update(self, data: memoryview | bytes) -> None:
        """Feed the next `len(data)` bytes of the payload."""
        view = memoryview(data).cast("B")
        self._fed += len(view)
        if self._fed > self._total:
            raise InvalidArgumentError(
                f"fed {self._fed} bytes to the checksums of a {self._total}-byte payload"
            )
        at, n = 0, len(view)
        crc = crc32c.crc32c
        while at < n:
            take = min(self._left, n - at)
            self._crc = crc(view[at : at + take], self._crc)
            at += take
            self._left -= take
            if self._left == 0:
                self.crcs.append(self._crc)
                self._crc = 0
                self._left = next(self._lengths, 0)

    def result(self) -> tuple[Shape, list[int]]:
        """(tile shape, crc32c of each tile), once the whole payload was fed."""
        if self._fed != self._total:
            raise InvalidArgumentError(
                f"checksums asked after {self._fed} of a {self._total}-byte payload"
            )
        if self._total == 0:  # an empty payload is one empty tile, as `checksum_payload` says
            return self.tile, [0]
        return self.tile, self.crcs
