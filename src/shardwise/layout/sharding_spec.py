"""The blocks a legacy `torch.distributed._shard` sharding spec gives each rank.

Read by duck typing (`dim` + `placements` for `ChunkShardingSpec`, `shards`
of `ShardMetadata` for `EnumerableShardingSpec`) so that the layout layer
never imports `torch.distributed`; building a spec back needs its classes and
so lives in `shardwise.interop.legacy` (`shardwise.legacy.to_sharding_spec`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import InvalidTypeError, LayoutError
from .block import Block

__all__ = ["blocks_from_sharding_spec"]


def _placement_rank(placement: Any, where: str) -> int:
    rank = placement.rank() if placement is not None and hasattr(placement, "rank") else None
    if not isinstance(rank, int):
        raise LayoutError(
            f"{where}: placement {placement!r} names no rank; shardwise needs placements "
            f"such as 'rank:0/cpu' (RPC worker names are not supported)"
        )
    return rank


def blocks_from_sharding_spec(
    spec: Any, shape: Sequence[int], world_size: int
) -> dict[int, list[Block]]:
    """rank -> its blocks, in the spec's order; empty blocks are left out
    (a legacy chunk past the end of the tensor holds nothing)."""
    shape = tuple(int(s) for s in shape)
    blocks: dict[int, list[Block]] = {}

    def add(rank: int, block: Block, where: str) -> None:
        if not 0 <= rank < world_size:
            raise LayoutError(
                f"{where}: placement rank {rank} is outside the world size {world_size}"
            )
        if not block.is_empty():
            blocks.setdefault(rank, []).append(block)

    if hasattr(spec, "dim") and hasattr(spec, "placements"):  # ChunkShardingSpec
        dim = spec.dim
        if not isinstance(dim, int) or not -len(shape) <= dim < len(shape):
            raise LayoutError(
                f"ChunkShardingSpec dim {dim!r} is not a dimension of a tensor of shape {shape}"
            )
        dim %= len(shape)
        parts = len(spec.placements)
        extent = shape[dim]
        split = -(-extent // parts) if parts else 0  # legacy get_split_size
        for i, placement in enumerate(spec.placements):
            start = min(split * i, extent)
            offsets = [0] * len(shape)
            sizes = list(shape)
            offsets[dim], sizes[dim] = start, min(split, extent - start)
            where = f"ChunkShardingSpec placement {i}"
            add(_placement_rank(placement, where), Block(offsets, sizes), where)
    elif hasattr(spec, "shards"):  # EnumerableShardingSpec
        for i, md in enumerate(spec.shards):
            where = f"EnumerableShardingSpec shard {i}"
            block = Block(md.shard_offsets, md.shard_sizes)
            if block.ndim != len(shape):
                raise LayoutError(f"{where} {block} is {block.ndim}-d but the shape {shape} is not")
            add(_placement_rank(md.placement, where), block, where)
    else:
        raise InvalidTypeError(
            f"expected a ChunkShardingSpec or EnumerableShardingSpec, got {type(spec).__name__}"
        )
    return blocks
