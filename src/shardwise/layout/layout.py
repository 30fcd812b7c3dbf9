"""`Layout`: which blocks of a global tensor each rank holds, validated once.

A layout is a value: immutable, compared and hashed by its global shape and
blocks, serialisable to plain JSON. Validation runs on construction and names
the rank, the block and the rule broken, so a bad layout never reaches a
collective.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from itertools import accumulate, chain, product
from typing import Any

from ..errors import LayoutError
from .block import Block
from .coverage import analyze

__all__ = ["Layout", "mesh_coordinates"]

JSON_FORMAT = "shardwise.layout"
JSON_VERSION = 1


def _chunk_sizes(extent: int, parts: int) -> list[int]:
    """Part sizes exactly as `torch.chunk` (and DTensor `Shard`) produce them."""
    if parts <= 0:
        raise LayoutError(f"the number of parts (world size) must be positive, got {parts}")
    step = -(-extent // parts) if extent else 0
    sizes = []
    for i in range(parts):
        start = min(i * step, extent)
        sizes.append(min(step, extent - start))
    return sizes


def _check_sizes(sizes: Sequence[int], extent: int, what: str) -> list[int]:
    sizes = [int(s) for s in sizes]
    if any(s < 0 for s in sizes):
        raise LayoutError(f"{what} sizes {sizes} must be non-negative (0 is allowed)")
    if sum(sizes) != extent:
        raise LayoutError(
            f"{what} sizes {sizes} add up to {sum(sizes)}, not the dimension's {extent}; "
            f"give sizes that add up to {extent} (0 is allowed)"
        )
    return sizes


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
        self._shape = shape
        self._blocks: tuple[tuple[Block, ...], ...] = tuple(
            tuple(blocks.get(rank, ())) for rank in range(world_size)
        )
        self._allow_holes = bool(allow_holes)
        self._hash: int | None = None
        self._holders: dict[Block, tuple[int, ...]] | None = None
        self._validate()

    # -- validation -------------------------------------------------------

    def _validate(self) -> None:
        """Check every rule, raising `LayoutError` for the first broken one."""
        shape = self._shape
        ndim = len(shape)
        # Replicas fold into one key; dict.fromkeys does it at C speed.
        distinct = list(dict.fromkeys(chain.from_iterable(self._blocks)))
        for block in distinct:
            if not isinstance(block, Block):
                raise TypeError(f"a layout holds Blocks, got {block!r}")
            if len(block.offsets) != ndim:
                rank, i = self._locate(block)
                raise LayoutError(
                    f"block {i} of rank {rank} {block} is {block.ndim}-d but the "
                    f"global shape {shape} is {ndim}-d (ndim)"
                )
        found = analyze(distinct, shape)
        if found.out_of_bounds is not None:
            b = found.out_of_bounds
            rank, i = self._locate(b)
            raise LayoutError(
                f"block {i} of rank {rank} {b} (offsets {b.offsets}) is out of bounds "
                f"of the global shape {shape}"
            )
        if found.overlap is not None:
            a, b = found.overlap
            raise LayoutError(
                f"blocks of rank {self._locate(a)[0]} {a} (offsets {a.offsets}) and rank "
                f"{self._locate(b)[0]} {b} (offsets {b.offsets}) partly overlap (global "
                f"shape {shape}); make them disjoint or identical (replicas)"
            )
        self._covered = found.covered
        if found.hole is not None and not self._allow_holes:
            raise LayoutError(
                f"the blocks cover {found.covered} of the {math.prod(shape)} elements of "
                f"global shape {shape}: element {found.hole} is a hole held by no rank; "
                f"add the missing blocks or pass allow_holes=True"
            )

    def _locate(self, block: Block) -> tuple[int, int]:
        """(rank, index) where `block` first appears."""
        for rank, rank_blocks in enumerate(self._blocks):
            if block in rank_blocks:
                return rank, rank_blocks.index(block)
        raise KeyError(block)

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
        return (_from_json_dict, (self._to_json_dict(),))

    # -- JSON ---------------------------------------------------------------

    def _to_json_dict(self) -> dict[str, Any]:
        return {
            "format": JSON_FORMAT,
            "version": JSON_VERSION,
            "global_shape": list(self._shape),
            "world_size": self.world_size,
            "allow_holes": self._allow_holes,
            "blocks": [
                [[b.offsets, b.sizes] for b in rank_blocks]  # tuples dump as lists
                for rank_blocks in self._blocks
            ],
        }

    def to_json(self) -> str:
        """Plain JSON that `Layout.from_json` turns back into an equal layout."""
        return json.dumps(self._to_json_dict(), separators=(",", ":"))

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
        dim = _normalize_dim(dim, len(shape))
        return cls.along(shape, dim, _chunk_sizes(shape[dim], world_size), None, world_size)

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
        return cls.along(shape, 0, _check_sizes(sizes, shape[0], "row_wise"), ranks, world_size)

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
        return cls.along(shape, 1, _check_sizes(sizes, shape[1], "column_wise"), ranks, world_size)

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
        shape = tuple(shape)
        dim = _normalize_dim(dim, len(shape))
        sizes = _check_sizes(sizes, shape[dim], f"dimension {dim}")
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
        shape = tuple(shape)
        grid = tuple(int(g) for g in grid)
        if len(grid) != len(shape):
            raise LayoutError(f"grid {grid} must have one entry per dimension of {shape}")
        if sizes is None:
            part_sizes = [_chunk_sizes(n, g) for n, g in zip(shape, grid)]
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
                part_sizes.append(_check_sizes(s, n, f"grid dimension {d}"))
        part_offsets = [[0, *accumulate(s[:-1])] for s in part_sizes]
        world_size = math.prod(grid)
        blocks: dict[int, list[Block]] = {}
        # itertools.product walks the grid row-major, which is rank order.
        parts = [list(zip(o, s)) for o, s in zip(part_offsets, part_sizes)]
        for rank, cell in enumerate(product(*parts)):
            block = Block(tuple(c[0] for c in cell), tuple(c[1] for c in cell))
            if not block.is_empty():
                blocks[rank] = [block]
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
        """The whole tensor on every rank."""
        shape = tuple(shape)
        whole = Block((0,) * len(shape), shape)
        return cls(shape, {r: [whole] for r in range(world_size)}, world_size)

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
                shard_dims.append(_normalize_dim(p.dim, len(shape)))
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
                parts = _chunk_sizes(sizes[dim], mesh_shape[mesh_dim])
                c = coords[mesh_dim]
                offsets[dim] += sum(parts[:c])
                sizes[dim] = parts[c]
            block = Block(tuple(offsets), tuple(sizes))
            if not block.is_empty():
                blocks[rank] = [block]
        return cls(shape, blocks, math.prod(mesh_shape))


def _normalize_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        valid = f"valid: {-ndim} to {ndim - 1}" if ndim else "it has no dimension to split"
        raise LayoutError(f"dimension {dim} is out of range for a {ndim}-d tensor ({valid})")
    return dim % ndim


def mesh_coordinates(index: int, extents: Sequence[int]) -> tuple[int, ...]:
    """The row-major coordinates of rank `index` in a mesh of shape `extents` (as DeviceMesh)."""
    coords = []
    for extent in reversed(extents):
        index, c = divmod(index, extent)
        coords.append(c)
    return tuple(reversed(coords))


def _from_json_dict(data: Any) -> Layout:
    if not isinstance(data, dict) or data.get("format") != JSON_FORMAT:
        raise LayoutError(f"not a shardwise layout document (format must be {JSON_FORMAT!r})")
    if data.get("version") != JSON_VERSION:
        raise LayoutError(
            f"layout JSON version {data.get('version')!r} is not supported "
            f"(this shardwise reads version {JSON_VERSION})"
        )
    try:
        blocks = {
            rank: [Block(tuple(o), tuple(s)) for o, s in rank_blocks]
            for rank, rank_blocks in enumerate(data["blocks"])
        }
        return Layout(
            data["global_shape"],
            blocks,
            data["world_size"],
            allow_holes=data.get("allow_holes", False),
        )
    except (KeyError, TypeError) as e:
        raise LayoutError(f"malformed layout JSON: {e!r}") from e
