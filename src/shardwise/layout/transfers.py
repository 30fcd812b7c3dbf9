"""`plan_transfers`: which source block feeds which destination block, and where.

Pure planning over two layouts, no process group: `comm/` executes the plan,
checkpoint loading reuses `BlockIndex`, and tests run it for 1,024 ranks in one
process.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from ..errors import LayoutError
from .block import Block
from .layout import Layout

__all__ = ["BlockIndex", "Transfer", "plan_transfers"]


@dataclass(frozen=True, slots=True)
class Transfer:
    """Copy `region` (global coordinates) from a source shard to a destination shard.

    `src_block_index` / `dst_block_index` index the rank's block list in the
    source / destination layout, i.e. its list of local shards.
    """

    src_rank: int
    src_block_index: int
    dst_rank: int
    dst_block_index: int
    region: Block

    @property
    def is_local(self) -> bool:
        return self.src_rank == self.dst_rank


class BlockIndex:
    """Find the blocks of a disjoint set that intersect a query box.

    When the blocks' boundaries form a modest grid of cells (every layout the
    builders make), each cell records the block covering it and a query reads
    only the cells inside the box: cost proportional to what it returns.
    Otherwise blocks are sorted by their start along the dimension that
    separates them best, and a query scans those whose extent along it meets
    its own.
    """

    _MAX_CELLS = 1 << 22

    def __init__(self, blocks: Sequence[Block]) -> None:
        blocks = [b for b in blocks if not b.is_empty()]
        self._blocks = blocks
        self._cells: torch.Tensor | None = None
        ndim = blocks[0].ndim if blocks else 0
        if ndim == 0:
            return
        cuts = [
            sorted({b.offsets[d] for b in blocks} | {b.ends[d] for b in blocks})
            for d in range(ndim)
        ]
        if math.prod(len(c) - 1 for c in cuts) <= self._MAX_CELLS:
            self._cuts = cuts
            cells = torch.full([len(c) - 1 for c in cuts], -1, dtype=torch.int32)
            for i, b in enumerate(blocks):
                cells[self._cell_slices(b)] = i
            self._cells = cells
            return
        d = max(range(ndim), key=lambda d: len({b.offsets[d] for b in blocks}))
        self._dim = d
        self._blocks = sorted(blocks, key=lambda b: b.offsets[d])
        self._starts = [b.offsets[d] for b in self._blocks]
        # prefix maximum of ends: the first block that can reach past a point
        self._reach = list(accumulate((b.ends[d] for b in self._blocks), max))

    def _cell_slices(self, box: Block) -> tuple[slice, ...]:
        """The cells a box overlaps (cells are cut at every block boundary)."""
        return tuple(
            slice(max(bisect_right(c, o) - 1, 0), bisect_left(c, e))
            for c, o, e in zip(self._cuts, box.offsets, box.ends)
        )

    def query(self, box: Block) -> list[tuple[Block, Block]]:
        """`(block, overlap)` for every indexed block sharing elements with `box`."""
        if box.ndim == 0:
            return [(b, b) for b in self._blocks]
        if not self._blocks:  # nothing was indexed along any dimension
            return []
        if self._cells is not None:
            window = self._cells[self._cell_slices(box)]
            # small windows (the common case) dedupe faster in Python than in torch.unique
            ids = (
                dict.fromkeys(window.flatten().tolist())
                if window.numel() <= 256
                else torch.unique(window).tolist()
            )
            candidates = [self._blocks[i] for i in ids if i >= 0]
        else:
            d = self._dim
            lo = bisect_right(self._reach, box.offsets[d])
            hi = bisect_left(self._starts, box.ends[d])
            candidates = self._blocks[lo:hi]
        out = []
        for block in candidates:
            overlap = block.intersect(box)
            if overlap is not None:
                out.append((block, overlap))
        return out


def plan_transfers(src: Layout, dst: Layout) -> list[Transfer]:
    """The copies that build every destination block from the source layout.

    Each element of each destination block is fetched exactly once; an element
    the destination rank already holds in `src` is always copied locally; among
    remote replicas the one with the fewest bytes planned so far is chosen.
    Raises `LayoutError` if the shapes differ or `src` lacks needed elements.
    """
    if src.global_shape != dst.global_shape:
        raise LayoutError(
            f"cannot plan transfers between global shapes {src.global_shape} and {dst.global_shape}"
        )
    # Where each distinct source block lives: rank -> index in that rank's list.
    where: dict[Block, dict[int, int]] = {}
    for rank, rank_blocks in enumerate(src.blocks):
        for i, block in enumerate(rank_blocks):
            where.setdefault(block, {}).setdefault(rank, i)
    index = BlockIndex(list(where))
    load = [0] * src.world_size  # elements each source rank is planned to send
    transfers: list[Transfer] = []
    for dst_rank, rank_blocks in enumerate(dst.blocks):
        for dst_index, dst_block in enumerate(rank_blocks):
            if dst_block.is_empty():
                continue
            found = 0
            for src_block, region in index.query(dst_block):
                holders = where[src_block]
                if dst_rank in holders:
                    src_rank = dst_rank
                elif len(holders) == 1:
                    (src_rank,) = holders
                    load[src_rank] += region.numel
                else:
                    n = src.world_size
                    # least loaded; ties broken by distance from dst_rank to spread reads
                    src_rank = min(holders, key=lambda r: (load[r], (r - dst_rank) % n))
                    load[src_rank] += region.numel
                transfers.append(Transfer(src_rank, holders[src_rank], dst_rank, dst_index, region))
                found += region.numel
            if found != dst_block.numel:
                raise LayoutError(
                    f"block {dst_index} of destination rank {dst_rank} {dst_block} needs "
                    f"{dst_block.numel} elements but the source layout holds only "
                    f"{found} of them (the source has holes there)"
                )
    return transfers
