"""The rules a layout must satisfy, checked once when it is built.

Each broken rule raises `LayoutError` naming the rank, the block and the rule
(ndim, bounds, partial overlap, coverage), so a bad layout never reaches a
collective.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from itertools import chain

from ..errors import InvalidTypeError, LayoutError
from .block import Block
from .coverage import analyze

__all__ = ["blocks_by_rank", "check_blocks"]

PerRank = tuple[tuple[Block, ...], ...]


def blocks_by_rank(
    global_shape: Sequence[int],
    blocks: Mapping[int, Sequence[Block]] | Sequence[Sequence[Block]],
    world_size: int | None,
) -> tuple[tuple[int, ...], PerRank]:
    """The global shape and every rank's blocks (indexed by rank) of `Layout`'s arguments."""
    shape = tuple(int(s) for s in global_shape)
    if any(s < 0 for s in shape):
        raise LayoutError(f"global shape {shape} has a negative dimension")
    if not isinstance(blocks, Mapping):
        blocks = dict(enumerate(blocks))
    for rank in blocks:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise LayoutError(f"rank {rank!r} is not a non-negative integer")
    max_rank = max(blocks, default=-1)
    if world_size is None:
        world_size = max_rank + 1
    if max_rank >= world_size:
        raise LayoutError(f"rank {max_rank} holds blocks but the world size is {world_size}")
    return shape, tuple(tuple(blocks.get(rank, ())) for rank in range(world_size))


def check_blocks(shape: tuple[int, ...], blocks: PerRank, allow_holes: bool) -> int:
    """How many elements `blocks` cover; `LayoutError` for the first rule broken."""
    ndim = len(shape)
    # Replicas fold into one key; dict.fromkeys does it at C speed.
    distinct = list(dict.fromkeys(chain.from_iterable(blocks)))
    for block in distinct:
        if not isinstance(block, Block):
            raise InvalidTypeError(f"a layout holds Blocks, got {block!r}")
        if len(block.offsets) != ndim:
            rank, i = _locate(blocks, block)
            raise LayoutError(
                f"block {i} of rank {rank} {block} is {block.ndim}-d but the "
                f"global shape {shape} is {ndim}-d (ndim)"
            )
    found = analyze(distinct, shape)
    if found.out_of_bounds is not None:
        b = found.out_of_bounds
        rank, i = _locate(blocks, b)
        raise LayoutError(
            f"block {i} of rank {rank} {b} (offsets {b.offsets}) is out of bounds "
            f"of the global shape {shape}"
        )
    if found.overlap is not None:
        a, b = found.overlap
        raise LayoutError(
            f"blocks of rank {_locate(blocks, a)[0]} {a} (offsets {a.offsets}) and rank "
            f"{_locate(blocks, b)[0]} {b} (offsets {b.offsets}) partly overlap (global "
            f"shape {shape}); make them disjoint or identical (replicas)"
        )
    if found.hole is not None and not allow_holes:
        raise LayoutError(
            f"the blocks cover {found.covered} of the {math.prod(shape)} elements of "
            f"global shape {shape}: element {found.hole} is a hole held by no rank; "
            f"add the missing blocks or pass allow_holes=True"
        )
    return found.covered


def _locate(blocks: PerRank, block: Block) -> tuple[int, int]:
    """(rank, index) where `block` first appears (it does: it was found among `blocks`)."""
    return next((r, bs.index(block)) for r, bs in enumerate(blocks) if block in bs)
