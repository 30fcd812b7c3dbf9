"""Tiled checksums: one crc32c per tile of a chunk, so a ranged read verifies only what it reads.

A stored chunk is a C-order array. Its tile grid covers it in C order (edge
tiles smaller), and each tile has the crc32c of its elements in C order, as if
the tile were a contiguous array. A sub-box of the chunk is verified by reading
the tile-aligned box that encloses it and checking the tiles in that box, so a
column band of a row-wise chunk costs the band widened to whole tiles, not the
chunk. `tile_shape` picks tiles that are contiguous in the payload (rows longer
than `RUN_BYTES` are split into `RUN_BYTES` column tiles), so checksumming a
payload is one crc32c call per tile, in memory order, never a copy.

Pure math and crc32c over buffers that are passed in: no I/O, no process group.
Format version 3 stores `tile` and `tiles` per chunk (docs/format.md).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import crc32c

from ...errors import LayoutError
from .byte_runs import c_strides, runs

__all__ = [
    "RUN_BYTES",
    "TILE_BYTES",
    "BadTile",
    "bad_tile",
    "bad_tile_in_box",
    "checksum_payload",
    "enclosing_box",
    "grid_shape",
    "payload_tiles",
    "tile_count",
    "tile_crcs",
    "tile_shape",
    "valid_tile",
]

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
    is the runs `byte_runs.runs` finds, computed once per tile size and moved."""
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
