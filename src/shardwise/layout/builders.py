"""The blocks of the common layouts: along one dimension, an N-d grid, a DTensor mesh.

Each builder returns `(blocks by rank, world size)` for `Layout` to validate;
the `Layout` classmethods (`along`, `grid`, `from_dtensor_spec`, ...) are the
public face.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import accumulate, product
from typing import Any

from ..errors import LayoutError
from .block import Block
from .splits import check_sizes, chunk_sizes, mesh_coordinates, normalize_dim

__all__ = ["along_blocks", "dtensor_blocks", "grid_blocks"]

Blocks = dict[int, list[Block]]


def along_blocks(
    shape: tuple[int, ...],
    dim: int,
    sizes: Sequence[int],
    ranks: Sequence[int] | None = None,
    world_size: int | None = None,
) -> tuple[Blocks, int]:
    """Consecutive blocks along `dim` of the given sizes, block `i` to `ranks[i]`."""
    shape = tuple(shape)
    dim = normalize_dim(dim, len(shape))
    sizes = check_sizes(sizes, shape[dim], f"dimension {dim}")
    if ranks is None:
        ranks = range(len(sizes))
    elif len(ranks) != len(sizes):
        raise LayoutError(
            f"{len(sizes)} block sizes but {len(ranks)} ranks; give one rank per block"
        )
    if world_size is None:
        world_size = max(ranks, default=-1) + 1
    blocks: dict[int, list[Block]] = {}
    start = 0
    for rank, size in zip(ranks, sizes):
        if size:
            offsets = tuple(start if d == dim else 0 for d in range(len(shape)))
            extent = tuple(size if d == dim else s for d, s in enumerate(shape))
            blocks.setdefault(rank, []).append(Block(offsets, extent))
        start += size
    return blocks, world_size


def grid_blocks(
    shape: tuple[int, ...], grid: Sequence[int], sizes: Sequence[Sequence[int]] | None
) -> tuple[Blocks, int]:
    """An N-d grid of blocks, one per rank, ranks row-major over grid coordinates."""
    shape = tuple(shape)
    grid = tuple(int(g) for g in grid)
    if len(grid) != len(shape):
        raise LayoutError(f"grid {grid} must have one entry per dimension of {shape}")
    if sizes is None:
        part_sizes = [chunk_sizes(n, g) for n, g in zip(shape, grid)]
    else:
        if len(sizes) != len(shape):
            raise LayoutError(f"sizes needs one list per dimension of {shape}, got {sizes}")
        part_sizes = []
        for d, (n, g, s) in enumerate(zip(shape, grid, sizes)):
            if len(s) != g:
                raise LayoutError(
                    f"dimension {d}: grid has {g} parts but {len(s)} sizes {list(s)}; "
                    f"give one size per part"
                )
            part_sizes.append(check_sizes(s, n, f"grid dimension {d}"))
    part_offsets = [[0, *accumulate(s[:-1])] for s in part_sizes]
    world_size = math.prod(grid)
    blocks: dict[int, list[Block]] = {}
    # itertools.product walks the grid row-major, which is rank order.
    parts = [list(zip(o, s)) for o, s in zip(part_offsets, part_sizes)]
    for rank, cell in enumerate(product(*parts)):
        block = Block(tuple(c[0] for c in cell), tuple(c[1] for c in cell))
        if not block.is_empty():
            blocks[rank] = [block]
    return blocks, world_size


def dtensor_blocks(
    mesh_shape: Sequence[int], placements: Sequence[Any], shape: tuple[int, ...]
) -> tuple[Blocks, int]:
    """The blocks of a DTensor with these placements on a mesh of this shape."""
    mesh_shape = tuple(int(m) for m in mesh_shape)
    shape = tuple(shape)
    if len(placements) != len(mesh_shape):
        raise LayoutError(
            f"{len(placements)} placements for a {len(mesh_shape)}-d mesh {mesh_shape}"
        )
    shard_dims: list[int | None] = []
    for p in placements:
        if p.is_replicate():
            shard_dims.append(None)
        elif p.is_shard():  # False for _StridedShard, whose blocks are not boxes
            shard_dims.append(normalize_dim(p.dim, len(shape)))
        else:
            raise LayoutError(
                f"placement {p!r} has no block layout; only Shard(dim) and Replicate() do"
            )
    blocks: dict[int, list[Block]] = {}
    for rank in range(math.prod(mesh_shape)):
        coords = mesh_coordinates(rank, mesh_shape)
        offsets = [0] * len(shape)
        sizes = list(shape)
        for mesh_dim, dim in enumerate(shard_dims):
            if dim is None:
                continue
            parts = chunk_sizes(sizes[dim], mesh_shape[mesh_dim])
            c = coords[mesh_dim]
            offsets[dim] += sum(parts[:c])
            sizes[dim] = parts[c]
        block = Block(tuple(offsets), tuple(sizes))
        if not block.is_empty():
            blocks[rank] = [block]
    return blocks, math.prod(mesh_shape)
