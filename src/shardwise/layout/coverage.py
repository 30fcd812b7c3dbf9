"""Do distinct blocks partly overlap, and is any element left uncovered?

Every layout asks both questions on construction, for up to ~100,000 blocks.
Two exact methods answer them:

* `_raster`: compress coordinates to the distinct block boundaries of each
  dimension, paint every block into that cell grid with an N-d difference
  array, and prefix-sum: a cell counted twice is an overlap, a cell counted
  zero times a hole. Vectorised in torch, O(n 2^ndim + cells); used when the
  cell grid is small, which it is for every row/column/grid/replica layout.
* `_overlap` / `_hole`: a recursive sweep that cuts along one dimension at
  every boundary and re-asks the question in the remaining dimensions for the
  blocks crossing each slab. Pure Python, O(n log n) on layouts whose blocks
  span few slabs; the fallback for irregular layouts with a huge cell grid.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from .block import Block

__all__ = ["Coverage", "analyze"]

# Above this many cells the raster costs more memory than it is worth.
_MAX_RASTER_CELLS = 1 << 22


@dataclass(frozen=True)
class Coverage:
    """What `analyze` found; at most the first problem of each kind."""

    out_of_bounds: Block | None = None
    overlap: tuple[Block, Block] | None = None
    hole: tuple[int, ...] | None = None
    covered: int = 0  # elements covered, counted once per distinct block


def analyze(blocks: Sequence[Block], shape: Sequence[int]) -> Coverage:
    """Check distinct blocks (replicas folded, all of `len(shape)` dims) against `shape`.

    Reports the first block out of bounds; otherwise two distinct blocks that
    share an element; otherwise one element that no block covers.
    """
    shape = tuple(shape)
    ndim = len(shape)
    if ndim == 0 or not blocks:
        covered = len(blocks) if ndim == 0 else 0
        hole = None if covered or math.prod(shape) == 0 else (0,) * ndim
        return Coverage(covered=covered, hole=hole)
    lo = torch.tensor([b.offsets for b in blocks], dtype=torch.int64)
    hi = torch.tensor([b.ends for b in blocks], dtype=torch.int64)
    outside = (hi > torch.tensor(shape, dtype=torch.int64)).any(1).nonzero()
    if len(outside):
        return Coverage(out_of_bounds=blocks[int(outside[0])])
    nonempty = (hi > lo).all(1)
    covered = int((hi - lo).prod(1).sum())
    if not bool(nonempty.all()):
        keep = nonempty.nonzero().flatten()
        blocks = [blocks[int(i)] for i in keep]
        lo, hi = lo[keep], hi[keep]
    if math.prod(shape) == 0:
        return Coverage(covered=covered)
    if not blocks:
        return Coverage(covered=covered, hole=(0,) * ndim)
    found = _raster(blocks, lo, hi, shape)
    if found is None:
        pair = _overlap(blocks, tuple(range(ndim))) if len(blocks) > 1 else None
        hole = None
        if pair is None and covered != math.prod(shape):
            hole = _hole(blocks, Block((0,) * ndim, shape), tuple(range(ndim)))
        found = pair, hole
    return Coverage(overlap=found[0], hole=found[1], covered=covered)


def _raster(
    blocks: Sequence[Block], lo: torch.Tensor, hi: torch.Tensor, shape: tuple[int, ...]
) -> tuple[tuple[Block, Block] | None, tuple[int, ...] | None] | None:
    """The raster method over non-empty blocks; None when the cell grid is too large."""
    ndim = len(shape)
    bounds = torch.tensor([[0] * ndim, list(shape)], dtype=torch.int64)
    lo, hi = lo.T.contiguous(), hi.T.contiguous()  # one row per dimension
    cuts = [torch.unique(torch.cat([lo[d], hi[d], bounds[:, d]])) for d in range(ndim)]
    if math.prod(len(c) - 1 for c in cuts) > _MAX_RASTER_CELLS:
        return None
    lo_cell = torch.stack([torch.searchsorted(cuts[d], lo[d]) for d in range(ndim)])
    hi_cell = torch.stack([torch.searchsorted(cuts[d], hi[d]) for d in range(ndim)])
    diff = torch.zeros([len(c) for c in cuts], dtype=torch.int32)
    for corner in range(1 << ndim):
        index = tuple(hi_cell[d] if (corner >> d) & 1 else lo_cell[d] for d in range(ndim))
        sign = -1 if bin(corner).count("1") % 2 else 1
        values = torch.full((len(blocks),), sign, dtype=torch.int32)
        diff.index_put_(index, values, accumulate=True)
    count = diff
    for d in range(ndim):
        count = count.cumsum(d, dtype=torch.int32)
    count = count[(slice(0, -1),) * ndim]

    def corner_of(cell: torch.Tensor) -> tuple[int, ...]:
        return tuple(int(cuts[d][cell[d]]) for d in range(ndim))

    doubled = (count > 1).nonzero()
    if len(doubled):
        point = torch.tensor(corner_of(doubled[0])).unsqueeze(1)
        inside = ((lo <= point) & (point < hi)).all(0).nonzero().flatten()
        return (blocks[int(inside[0])], blocks[int(inside[1])]), None
    empty = (count == 0).nonzero()
    return None, corner_of(empty[0]) if len(empty) else None


def _duplication_cost(blocks: Sequence[Block], dim: int) -> int:
    """How many (block, slab) pairs cutting along `dim` would create."""
    cuts = sorted({b.offsets[dim] for b in blocks} | {b.ends[dim] for b in blocks})
    return sum(
        bisect_left(cuts, b.offsets[dim] + b.sizes[dim]) - bisect_left(cuts, b.offsets[dim])
        for b in blocks
    )


def _best_dim(blocks: Sequence[Block], dims: Sequence[int]) -> int:
    if len(dims) == 1:
        return dims[0]
    return min(dims, key=lambda d: _duplication_cost(blocks, d))


def _slabs(
    blocks: Sequence[Block], dim: int, lo: int, hi: int
) -> Iterator[tuple[int, int, list[Block], bool]]:
    """Yield `(start, end, crossing_blocks, changed)` for every slab of [lo, hi).

    `changed` is False when the slab is crossed by exactly the blocks of the
    previous one, which lets callers skip re-checking an identical set.
    """
    cuts = sorted({lo, hi} | {b.offsets[dim] for b in blocks} | {b.ends[dim] for b in blocks})
    cuts = [c for c in cuts if lo <= c <= hi]
    by_start = sorted(blocks, key=lambda b: b.offsets[dim])
    starts = [b.offsets[dim] for b in by_start]
    active: dict[int, Block] = {}
    ending: list[tuple[int, int]] = []  # (end along dim, key) of active blocks
    next_block = 0
    changed = True
    for start, end in zip(cuts, cuts[1:]):
        while ending and ending[0][0] <= start:
            del active[heapq.heappop(ending)[1]]
            changed = True
        stop = bisect_right(starts, start)
        while next_block < stop:
            block = by_start[next_block]
            if block.ends[dim] > start:
                active[next_block] = block
                heapq.heappush(ending, (block.ends[dim], next_block))
                changed = True
            next_block += 1
        yield start, end, list(active.values()), changed
        changed = False


def _overlap(blocks: Sequence[Block], dims: tuple[int, ...]) -> tuple[Block, Block] | None:
    if len(blocks) < 2:
        return None
    if not dims:
        # Every dimension was cut and these still share a slab: they overlap.
        return blocks[0], blocks[1]
    dim = _best_dim(blocks, dims)
    rest = tuple(d for d in dims if d != dim)
    lo = min(b.offsets[dim] for b in blocks)
    hi = max(b.ends[dim] for b in blocks)
    for _, _, crossing, changed in _slabs(blocks, dim, lo, hi):
        if changed and len(crossing) > 1:
            found = _overlap(crossing, rest)
            if found is not None:
                return found
    return None


def _hole(blocks: Sequence[Block], region: Block, dims: tuple[int, ...]) -> tuple[int, ...] | None:
    if not blocks:
        return region.offsets
    if not dims:
        return None
    dim = _best_dim(blocks, dims)
    rest = tuple(d for d in dims if d != dim)
    lo, hi = region.offsets[dim], region.ends[dim]
    for start, end, crossing, changed in _slabs(blocks, dim, lo, hi):
        if not crossing:
            point = list(region.offsets)
            point[dim] = start
            return tuple(point)
        if changed:
            offsets = list(region.offsets)
            sizes = list(region.sizes)
            offsets[dim], sizes[dim] = start, end - start
            found = _hole(crossing, Block(tuple(offsets), tuple(sizes)), rest)
            if found is not None:
                return found
    return None
