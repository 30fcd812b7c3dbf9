"""`Layout`: which blocks of a global tensor each rank holds, validated once.

A layout is a value: immutable, compared and hashed by its global shape and
blocks, serialisable to plain JSON. Validation runs on construction and names
the rank, the block and the rule broken, so a bad layout never reaches a
collective.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import LayoutError
from .block import Block
from .builders import along_blocks, dtensor_blocks, grid_blocks
from .layout_json import layout_args, to_json_dict
from .rules import blocks_by_rank, check_blocks
from .splits import check_sizes, chunk_sizes, mesh_coordinates, normalize_dim

__all__ = ["Layout", "mesh_coordinates"]

_chunk_sizes = chunk_sizes  # interop/scatter.py imports it under this name


class Layout:
    """The blocks of a global tensor held by each rank of a group.

    `blocks` maps rank to the ordered list of blocks it holds; the order is
    the order of that rank's local shards. Ranks absent from the mapping (or
    mapped to an empty list) hold nothing. Two blocks must be identical
    (replicas of the same data) or disjoint; by default they must also cover
    the whole tensor, which `allow_holes=True` lifts.
    """

    __slots__ = ("_shape", "_blocks", "_allow_holes", "_holders", "_covered", "_hash")

    def __init__(
        self,
        global_shape: Sequence[int],
        blocks: Mapping[int, Sequence[Block]] | Sequence[Sequence[Block]],
        world_size: int | None = None,
        *,
        allow_holes: bool = False,
    ) -> None:
        self._shape, self._blocks = blocks_by_rank(global_shape, blocks, world_size)
        self._allow_holes = bool(allow_holes)
        self._hash: int | None = None
        self._holders: dict[Block, tuple[int, ...]] | None = None
        self._covered = check_blocks(self._shape, self._blocks, self._allow_holes)

    def _holder_map(self) -> dict[Block, tuple[int, ...]]:
        # Built on first use: validation alone does not need it.
        if self._holders is None:
            holders: dict[Block, list[int]] = {}
            for rank, rank_blocks in enumerate(self._blocks):
                for block in rank_blocks:
                    ranks = holders.setdefault(block, [])
                    if not ranks or ranks[-1] != rank:
                        ranks.append(rank)
            self._holders = {b: tuple(r) for b, r in holders.items()}
        return self._holders

    # -- value semantics --------------------------------------------------

    @property
    def global_shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def world_size(self) -> int:
        return len(self._blocks)

    @property
    def allow_holes(self) -> bool:
        return self._allow_holes

    @property
    def blocks(self) -> tuple[tuple[Block, ...], ...]:
        """Every rank's blocks, indexed by rank."""
        return self._blocks

    def blocks_of(self, rank: int) -> tuple[Block, ...]:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} is outside world size {self.world_size}")
        return self._blocks[rank]

    def ranks_holding(self, block: Block) -> tuple[int, ...]:
        """Ranks whose block lists contain exactly `block` (its replicas)."""
        return self._holder_map().get(block, ())

    @property
    def distinct_blocks(self) -> tuple[Block, ...]:
        """Each block once, replicas folded, in first-seen rank order."""
        return tuple(self._holder_map())

    @property
    def replica_groups(self) -> dict[Block, tuple[int, ...]]:
        """Blocks held by two or more ranks, each with the ranks holding it."""
        return {b: r for b, r in self._holder_map().items() if len(r) > 1}

    @property
    def is_fully_covered(self) -> bool:
        return self._covered == math.prod(self._shape)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Layout):
            return NotImplemented
        return self._shape == other._shape and self._blocks == other._blocks

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash((self._shape, self._blocks))
        return self._hash

    def __repr__(self) -> str:
        blocks = {r: list(b) for r, b in enumerate(self._blocks) if b}
        holes = ", allow_holes=True" if self._allow_holes else ""
        return (
            f"Layout(global_shape={self._shape}, blocks={blocks}, "
            f"world_size={self.world_size}{holes})"
        )

    def __str__(self) -> str:
        n = sum(len(b) for b in self._blocks)
        shape = "x".join(map(str, self._shape)) or "scalar"
        return f"Layout({shape}, {n} blocks on {self.world_size} ranks)"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_from_json_dict, (to_json_dict(self),))

    # -- JSON ---------------------------------------------------------------

    def to_json(self) -> str:
        """Plain JSON that `Layout.from_json` turns back into an equal layout."""
        return json.dumps(to_json_dict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Layout:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise LayoutError(f"layout JSON does not parse: {e}") from e
        return _from_json_dict(data)

    # -- builders -----------------------------------------------------------

    @classmethod
    def chunked(cls, shape: Sequence[int], dim: int, world_size: int) -> Layout:
        """Split `dim` exactly as `torch.chunk` / DTensor `Shard(dim)` do.

        Ranks past the last non-empty chunk hold nothing.
        """
        shape = tuple(shape)
        dim = normalize_dim(dim, len(shape))
        return cls.along(shape, dim, chunk_sizes(shape[dim], world_size), None, world_size)

    @classmethod
    def row_wise(
        cls,
        shape: Sequence[int],
        sizes: Sequence[int],
        *,
        ranks: Sequence[int] | None = None,
        world_size: int | None = None,
    ) -> Layout:
        """Consecutive row blocks of the given (uneven, possibly 0) sizes.

        Block `i` goes to `ranks[i]` (default: rank `i`), so a rank may hold
        several blocks.
        """
        shape = tuple(shape)
        if len(shape) < 1:
            raise LayoutError(f"row_wise needs a tensor of at least 1 dimension, got shape {shape}")
        return cls.along(shape, 0, check_sizes(sizes, shape[0], "row_wise"), ranks, world_size)

    @classmethod
    def column_wise(
        cls,
        shape: Sequence[int],
        sizes: Sequence[int],
        *,
        ranks: Sequence[int] | None = None,
        world_size: int | None = None,
    ) -> Layout:
        """Consecutive column blocks; `ranks=[0, 1, 0, 1]` gives two blocks per rank."""
        shape = tuple(shape)
        if len(shape) < 2:
            raise LayoutError(
                f"column_wise needs a tensor of at least 2 dimensions, got shape {shape}; "
                f"use row_wise for a 1-d tensor"
            )
        return cls.along(shape, 1, check_sizes(sizes, shape[1], "column_wise"), ranks, world_size)

    @classmethod
    def along(
        cls,
        shape: Sequence[int],
        dim: int,
        sizes: Sequence[int],
        ranks: Sequence[int] | None = None,
        world_size: int | None = None,
    ) -> Layout:
        """Consecutive blocks along `dim` of the given sizes.

        Block `i` goes to `ranks[i]` (default: rank `i`).
        """
        blocks, world_size = along_blocks(tuple(shape), dim, sizes, ranks, world_size)
        return cls(shape, blocks, world_size)

    @classmethod
    def grid(
        cls,
        shape: Sequence[int],
        grid: Sequence[int],
        sizes: Sequence[Sequence[int]] | None = None,
    ) -> Layout:
        """An N-d grid of blocks, one per rank, ranks row-major over grid coordinates.

        `grid[d]` is the number of parts along dimension `d`; `sizes[d]`, when
        given, lists their sizes (otherwise `torch.chunk` sizes).
        """
        blocks, world_size = grid_blocks(tuple(shape), grid, sizes)
        return cls(shape, blocks, world_size)

    @classmethod
    def table_wise(cls, shape: Sequence[int], rank: int, world_size: int) -> Layout:
        """The whole tensor on one rank; the others hold nothing."""
        shape = tuple(shape)
        if not 0 <= rank < world_size:
            raise LayoutError(
                f"table_wise rank {rank} is outside world size {world_size}; "
                f"pick a rank in range({world_size})"
            )
        return cls(shape, {rank: [Block((0,) * len(shape), shape)]}, world_size)

    @classmethod
    def replicated(cls, shape: Sequence[int], world_size: int) -> Layout:
        """The whole tensor on every rank. One object per shape and world size: every
        reduction's result and every `full_tensor()` asks for one, and checking its
        coverage anew costs more than a small op."""
        if cls is not Layout:
            shape = tuple(shape)
            whole = Block((0,) * len(shape), shape)
            return cls(shape, {r: [whole] for r in range(world_size)}, world_size)
        return _replicated(tuple(int(n) for n in shape), int(world_size))

    @classmethod
    def from_sharding_spec(cls, spec: Any, shape: Sequence[int], world_size: int) -> Layout:
        """The layout a legacy `ChunkShardingSpec` / `EnumerableShardingSpec` gives a
        tensor of `shape` over `world_size` ranks (placement ranks are ranks of the group).

        The spec is read by its attributes, so this layer stays free of
        `torch.distributed`; the way back, which must build torch's spec
        classes, is `shardwise.legacy.to_sharding_spec(layout)`.
        """
        from .sharding_spec import blocks_from_sharding_spec

        return cls(shape, blocks_from_sharding_spec(spec, shape, world_size), world_size)

    @classmethod
    def from_dtensor_spec(
        cls, mesh_shape: Sequence[int], placements: Sequence[Any], shape: Sequence[int]
    ) -> Layout:
        """The layout of a DTensor with these placements on a mesh of this shape.

        `placements` holds DTensor `Shard(d)` / `Replicate()` objects (or
        anything with their `is_shard()` / `is_replicate()` / `dim`); several
        mesh dimensions may shard the same tensor dimension, nested in mesh
        order, as DTensor does. Ranks are numbered row-major over the mesh.
        """
        blocks, world_size = dtensor_blocks(mesh_shape, placements, tuple(shape))
        return cls(shape, blocks, world_size)


def _from_json_dict(data: Any) -> Layout:
    """The layout a JSON document describes (what `Layout.__reduce__` pickles)."""
    shape, blocks, world_size, allow_holes = layout_args(data)
    try:
        return Layout(shape, blocks, world_size, allow_holes=allow_holes)
    except (KeyError, TypeError) as e:
        raise LayoutError(f"malformed layout JSON: {e!r}") from e


@functools.lru_cache(maxsize=4096)
def _replicated(shape: tuple[int, ...], world_size: int) -> Layout:
    whole = Block((0,) * len(shape), shape)
    return Layout(shape, {r: [whole] for r in range(world_size)}, world_size)
