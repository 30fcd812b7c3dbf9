"""PhysicsNeMo's `ShardTensor` <-> shardwise ShardedTensor, over the same local tensor.

A ShardTensor shards a tensor unevenly over a device mesh and records, in its
spec, every neighbour's piece shape along each sharded mesh dimension
(`_spec.sharding_shapes()`, PhysicsNeMo's own bookkeeping). shardwise reads
those sizes instead of inferring them again:

- `from_shard_tensor(st)`: the same data as a ShardedTensor holding the very
  local tensor (no copy). Collective: the ranks exchange their blocks once and
  check the whole layout (recorded sizes against the pieces actually held,
  overlaps, holes), raising the same error on every rank, naming the rank.
- `to_shard_tensor(st, mesh, placements)`: a ShardTensor wrapping this rank's
  very shard, with the sharding shapes stated explicitly (no communication).
  The layout must be a grid those placements express: Shard(d) with any
  (uneven, zero) sizes, Replicate, on meshes of any dimension, each tensor
  dimension sharded by at most one mesh dimension; otherwise `LayoutError`.
- ShardTensors in `swc.save`/`swc.load` go through
  `shardwise.checkpoint.clients.physicsnemo`'s value adapter.

PhysicsNeMo itself is imported only inside `to_shard_tensor`; this module never
imports it first (a ShardTensor in hand means it is loaded).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..comm.agreement import Problem
from ..errors import LayoutError, ShardMismatchError
from ..layout import Block, Layout
from ..layout.layout import mesh_coordinates
from ..tensor import ShardedTensor
from .agreed import (
    SHARD_TENSOR,
    Inspection,
    base_meta,
    convert_agreed,
    mesh_position,
    shared_local,
)

__all__ = ["from_shard_tensor", "inspect_shard_tensor", "to_shard_tensor"]


def from_shard_tensor(st: Any) -> ShardedTensor:
    """The ShardTensor `st` as a ShardedTensor sharing its local tensor. Collective.

    Block offsets come from the sizes the ShardTensor's spec records. Anything
    that is not a ShardTensor, Partial placements, a tensor dimension sharded
    by two mesh dimensions, or recorded sizes that disagree with the pieces the
    ranks hold raise the same error on every rank, naming the faulty rank.
    """
    return convert_agreed(
        st, {SHARD_TENSOR: inspect_shard_tensor}, "from_shard_tensor", SHARD_TENSOR
    )


def _rank_at(coords: Sequence[int], extents: Sequence[int]) -> int:
    rank = 0
    for c, extent in zip(coords, extents):
        rank = rank * extent + c
    return rank


def _sharded_dims(placements: Sequence[Any], ndim: int) -> dict[int, int]:
    """{mesh dim: tensor dim it shards}; Partial and nested sharding have no block layout here."""
    sharded: dict[int, int] = {}
    for m, p in enumerate(placements):
        if p.is_replicate():
            continue
        if not (p.is_shard() and type(p).__name__ == "Shard"):
            raise LayoutError(
                f"placement {p!r} (mesh dimension {m}) has no block layout; only Shard(dim) "
                f"and Replicate() do (redistribute a Partial ShardTensor first)"
            )
        d = p.dim % ndim if ndim else p.dim
        if d in sharded.values():
            raise LayoutError(
                f"tensor dimension {d} is sharded by several mesh dimensions "
                f"{tuple(placements)}; shardwise converts ShardTensors whose mesh dimensions "
                f"shard distinct tensor dimensions"
            )
        sharded[m] = d
    return sharded


def inspect_shard_tensor(st: Any) -> Inspection:
    """This rank's block from the sizes its spec records, checked against its local tensor."""
    spec = st._spec
    mesh_shape = tuple(spec.mesh.shape)
    rank = mesh_position(spec.mesh)
    shape, local = tuple(st.shape), st._local_tensor
    sharded = _sharded_dims(spec.placements, len(shape))
    recorded = spec._sharding_shapes
    if sharded and recorded is None:
        raise LayoutError(
            "its ShardTensor records no sharding shapes (spec._sharding_shapes is None)"
        )
    held = tuple(local.shape)
    if len(held) != len(shape):
        raise LayoutError(
            f"its local tensor is {len(held)}-d but the ShardTensor is {len(shape)}-d (ndim)"
        )
    coords = mesh_coordinates(rank, mesh_shape)
    offsets, seen = [0] * len(shape), {}
    for m, d in sharded.items():
        sizes = [int(s[d]) for s in recorded.get(m, ())]
        if len(sizes) != mesh_shape[m]:
            raise LayoutError(
                f"its ShardTensor records {len(sizes)} piece shapes for mesh dimension {m} of size "
                f"{mesh_shape[m]}"
            )
        if sizes[coords[m]] != held[d]:
            raise LayoutError(
                f"its local tensor has shape {held} but its ShardTensor records {sizes[coords[m]]} "
                f"along dimension {d} for it (recorded sizes {sizes})"
            )
        offsets[d], seen[m] = sum(sizes[: coords[m]]), sizes
    for d in set(range(len(shape))) - set(sharded.values()):
        if held[d] != shape[d]:
            raise LayoutError(
                f"its local tensor has shape {held} but dimension {d}, not sharded, has {shape[d]} "
                "globally"
            )
    meta = base_meta(st, SHARD_TENSOR)
    meta.update(coords=coords, held=held, seen=seen, offsets=tuple(offsets))

    def check(everyone: list[dict[str, Any]]) -> list[Problem]:
        return _recorded_vs_held(everyone, mesh_shape, sharded)

    def finish(everyone: list[dict[str, Any]], group: Any, mesh: Any) -> ShardedTensor:
        blocks = {
            r: [Block(m["offsets"], m["held"])]
            for r, m in enumerate(everyone)
            if math.prod(m["held"])
        }
        layout = Layout(shape, blocks, len(everyone))  # same data everywhere: raises alike
        out = shared_local(st, layout, rank, group, mesh)
        out._placements = tuple(spec.placements)
        # PhysicsNeMo's `offsets()`: per mesh dimension, the offset along the dimension it shards.
        out._mesh_offsets = tuple(
            offsets[sharded[m]] if m in sharded else 0 for m in range(len(mesh_shape))
        )
        return out

    return Inspection(meta, finish, check)


def _recorded_vs_held(
    everyone: list[dict[str, Any]], mesh_shape: tuple[int, ...], sharded: dict[int, int]
) -> list[Problem]:
    """Each rank whose spec records a neighbour's piece size that the neighbour does not hold."""
    problems: list[Problem] = [None] * len(everyone)
    for r, meta in enumerate(everyone):
        for m, sizes in meta["seen"].items():
            d = sharded[m]
            for k, size in enumerate(sizes):
                coords = list(meta["coords"])
                coords[m] = k
                q = _rank_at(coords, mesh_shape)
                if everyone[q]["held"][d] != size and problems[r] is None:
                    problems[r] = (
                        LayoutError,
                        (
                            f"its ShardTensor records rank {q}'s piece as {size} along dimension "
                            f"{d} "
                            f"but rank {q} holds {everyone[q]['held'][d]} (recorded sizes "
                            f"{sizes}); "
                            f"its sharding shapes are stale or wrong"
                        ),
                    )
    return problems


def _grid_sizes(
    layout: Layout, mesh_shape: tuple[int, ...], sharded: dict[int, int]
) -> dict[int, list[int]]:
    """Per sharded mesh dimension, the piece sizes along its tensor dimension (0 where no rank
    at that coordinate holds anything)."""
    sizes = {m: [0] * mesh_shape[m] for m in sharded}
    for rank in range(layout.world_size):
        blocks = layout.blocks_of(rank)
        if blocks:
            coords = mesh_coordinates(rank, mesh_shape)
            for m, d in sharded.items():
                sizes[m][coords[m]] = blocks[0].sizes[d]
    return sizes


Sizes = dict[
    int, list[int]
]  # per sharded mesh dimension, the piece sizes along its tensor dimension


def _cell(
    shape: tuple[int, ...], sharded: dict[int, int], sizes: Sizes, coords: Sequence[int]
) -> Block:
    offsets, extent = [0] * len(shape), list(shape)
    for m, d in sharded.items():
        offsets[d], extent[d] = sum(sizes[m][: coords[m]]), sizes[m][coords[m]]
    return Block(tuple(offsets), tuple(extent))


def _grid_layout(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    sharded: dict[int, int],
    sizes: dict[int, list[int]],
) -> Layout:
    blocks = {}
    for rank in range(math.prod(mesh_shape)):
        block = _cell(shape, sharded, sizes, mesh_coordinates(rank, mesh_shape))
        if not block.is_empty():
            blocks[rank] = [block]
    return Layout(shape, blocks, math.prod(mesh_shape))


def _expresses(
    layout: Layout, mesh_shape: tuple[int, ...], sharded: dict[int, int], sizes: Sizes
) -> bool:
    try:
        return _grid_layout(layout.global_shape, mesh_shape, sharded, sizes) == layout
    except (LayoutError, ValueError):  # sizes read off a non-grid layout: holes or overlaps
        return False


def to_shard_tensor(st: ShardedTensor, mesh: Any, placements: Sequence[Any]) -> Any:
    """A ShardTensor over `mesh` wrapping this rank's very shard (no copy, no communication).

    The layout must be what `placements` give with some per-rank sizes (uneven
    and zero sizes welcome); the sizes are read off the layout and handed to
    `ShardTensor.from_local` as its sharding shapes. Otherwise `LayoutError`:
    redistribute to such a layout first.
    """
    from physicsnemo.domain_parallel import ShardTensor

    placements, mesh_shape, shape = tuple(placements), tuple(mesh.shape), tuple(st.shape)
    rank = mesh_position(mesh)
    if math.prod(mesh_shape) != st.layout_spec.world_size:
        raise LayoutError(
            f"the mesh of shape {mesh_shape} has {math.prod(mesh_shape)} ranks but the layout "
            "spans "
            f"{st.layout_spec.world_size}"
        )
    if len(placements) != len(mesh_shape):
        raise LayoutError(
            f"{len(placements)} placements for a {len(mesh_shape)}-d mesh {mesh_shape}"
        )
    if mesh.device_type != st.device.type:
        raise ShardMismatchError(
            f"rank {rank}: the mesh is on {mesh.device_type} but the shards on {st.device.type}; "
            f"ShardTensor.from_local would copy them"
        )
    sharded = _sharded_dims(placements, len(shape))
    sizes = _grid_sizes(st.layout_spec, mesh_shape, sharded)
    if not _expresses(st.layout_spec, mesh_shape, sharded, sizes):
        raise LayoutError(
            f"{st.layout_spec} cannot be expressed as placements {placements} on a mesh of shape "
            f"{mesh_shape} with any per-rank sizes; redistribute first"
        )
    coords = mesh_coordinates(rank, mesh_shape)
    shards = st._shards
    local = (
        shards[0]
        if shards
        else torch.empty(
            _cell(shape, sharded, sizes, coords).sizes, dtype=st.dtype, device=st.device
        )
    )
    sharding_shapes = {
        m: [_neighbour(shape, sharded, sizes, coords, m, k) for k in range(mesh_shape[m])]
        for m in sharded
    }
    return ShardTensor.from_local(local, mesh, placements, sharding_shapes=sharding_shapes)


def _neighbour(
    shape: tuple[int, ...],
    sharded: dict[int, int],
    sizes: Sizes,
    coords: Sequence[int],
    m: int,
    k: int,
) -> tuple[int, ...]:
    """The piece shape of the rank at `coords` moved to `k` along mesh dimension `m`
    (PhysicsNeMo's cross-section convention for sharding shapes)."""
    moved = list(coords)
    moved[m] = k
    return _cell(shape, sharded, sizes, moved).sizes
