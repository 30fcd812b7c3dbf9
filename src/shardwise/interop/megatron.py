"""Megatron-Core's sharded tensors <-> shardwise ShardedTensors, over the same storage.

Megatron-Core describes each rank's piece of a global tensor with a
`dist_checkpointing.ShardedTensor` (key, local data, global shape and offset,
`replica_id`, `prepend_axis_num`: leading axes of size 1 the data lacks) and
hands them to DCP wrapped as `CheckpointableShardedTensor` (one piece) or
`LocalShardsContainer` (several pieces of one key on one rank).

- `to_shardwise(value)`: any of those (or a list of pieces of one key) as one
  shardwise `ShardedTensor` over the same storage. Collective: the global
  layout needs every rank's pieces (`shardwise.comm.from_local_shards`, which
  raises the same error on every rank).
- `to_megatron(state_dict)`: shardwise ShardedTensors as Megatron
  ShardedTensors over the same storage (one per local block, replicas numbered
  by rank), ready for `dist_checkpointing.save/load`.

Checkpoints (Megatron objects in `swc.save`/`swc.load`, and the files Megatron's
own `dist_checkpointing.load` needs) are `shardwise.checkpoint.clients.megatron`'s.

Megatron itself is imported only inside these functions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..comm.build import from_local_shards_checked
from ..errors import InvalidTypeError, ShardMismatchError
from ..layout import Block, Layout
from ..tensor import ShardedTensor

__all__ = [
    "block_data",
    "is_main_replica",
    "is_mapping_class",
    "is_mcore_object",
    "is_mcore_piece",
    "is_mcore_value",
    "pieces_of",
    "to_megatron",
    "to_shardwise",
    "pieces_problem",
]

_MAPPING = "megatron.core.dist_checkpointing.mapping"


def _mapping() -> Any:
    import megatron.core.dist_checkpointing.mapping as mapping

    return mapping


def is_mcore_piece(value: Any) -> bool:
    """A Megatron `dist_checkpointing.ShardedTensor` (one piece of a key)."""
    return type(value).__module__ == _MAPPING and type(value).__name__ == "ShardedTensor"


def is_mcore_object(value: Any) -> bool:
    """A Megatron `ShardedObject` (a pickled object with a unique key)."""
    return type(value).__module__ == _MAPPING and type(value).__name__ == "ShardedObject"


def _is_wrapper(value: Any) -> bool:
    return type(value).__name__ in ("CheckpointableShardedTensor", "LocalShardsContainer") and type(
        value
    ).__module__.startswith("megatron.core.dist_checkpointing")


def pieces_of(value: Any) -> list[Any]:
    """The Megatron ShardedTensors a value stands for (a list for a container)."""
    if is_mcore_piece(value):
        return [value]
    if _is_wrapper(value):
        if type(value).__name__ == "LocalShardsContainer":
            return [shard._sh_ten for shard in value._local_shards]
        return [value._sh_ten]
    if isinstance(value, (list, tuple)) and all(is_mcore_piece(v) for v in value):
        return list(value)
    raise InvalidTypeError(
        f"expected a Megatron ShardedTensor, a list of them, a CheckpointableShardedTensor or a "
        f"LocalShardsContainer, got {type(value).__name__}"
    )


def is_main_replica(replica_id: Any) -> bool:
    """Megatron's `is_main_replica`: 0, or a tuple of zeros."""
    return replica_id == 0 if isinstance(replica_id, int) else all(r == 0 for r in replica_id)


def pieces_problem(pieces: list[Any]) -> BaseException | None:
    """What makes this rank's pieces unusable (checked before the collective)."""
    if not pieces:
        return None
    first = pieces[0]
    for p in pieces:
        if p.flattened_range is not None:
            return ShardMismatchError(f"key '{p.key}': flattened_range pieces are not supported")
        if (p.key, tuple(p.global_shape), p.dtype) != (
            first.key,
            tuple(first.global_shape),
            first.dtype,
        ):
            return ShardMismatchError(
                f"pieces of one value disagree: '{p.key}' {tuple(p.global_shape)} {p.dtype} vs "
                f"'{first.key}' {tuple(first.global_shape)} {first.dtype}"
            )
        if p.data is not None and (_shape_problem(p) or p.data.dtype != p.dtype):
            return ShardMismatchError(
                f"key '{p.key}' at offset {tuple(p.global_offset)}: data "
                f"{tuple(p.data.shape)} {p.data.dtype} does not match local_shape "
                f"{tuple(p.local_shape)} / dtype {p.dtype}"
            )
    return None


def _shape_problem(piece: Any) -> bool:
    """Whether the data is not the piece's local shape: as Megatron made it, or with the
    prepended axes as Megatron's own save leaves it (it views the data so, in place)."""
    local = tuple(piece.local_shape)
    return tuple(piece.data.shape) not in (local, (1,) * piece.prepend_axis_num + local)


def block_data(piece: Any) -> torch.Tensor:
    """The piece's data as a block of the global tensor: prepended axes as a view."""
    data = piece.data.detach()
    if not data.is_contiguous():
        data = data.contiguous()  # a copy, only where the data is strided
    return data.view((1,) * piece.prepend_axis_num + tuple(piece.local_shape))


def to_shardwise(
    value: Any,
    *,
    replicas: bool = True,
    global_shape: Sequence[int] | None = None,
    group: Any = None,
) -> ShardedTensor:
    """One shardwise ShardedTensor from this rank's Megatron pieces of one key. Collective.

    `value`: a Megatron ShardedTensor, a list of them (several pieces of one
    key; `[]` on a rank holding nothing, which then must pass `global_shape`),
    a `CheckpointableShardedTensor` or a `LocalShardsContainer`. The shards
    share the pieces' storage (a strided piece is copied). `replicas=False`
    keeps only main replicas (`replica_id` 0, the data owners); with `True`
    every replica is a block of its own rank (what a load fills, and what a save
    writes once). Problems on any rank raise on every rank.
    """
    return from_local_shards_checked(*_described(value, replicas, global_shape), group)


def _described(
    value: Any, replicas: bool, global_shape: Sequence[int] | None
) -> tuple[list[torch.Tensor], list[tuple[int, ...]], tuple[int, ...] | None, Any]:
    """(shards, offsets, global shape, problem) of this rank's pieces of one key."""
    pieces = pieces_of(value)
    problem = pieces_problem(pieces)
    if problem is None and any(p.data is None for p in pieces):
        problem = ShardMismatchError(f"key '{pieces[0].key}': a piece has no data (call init_data)")
    kept = (
        [p for p in pieces if replicas or is_main_replica(p.replica_id)] if problem is None else []
    )
    shape = (
        tuple(global_shape)
        if global_shape is not None
        else (tuple(pieces[0].global_shape) if pieces else None)
    )
    return [block_data(p) for p in kept], [tuple(p.global_offset) for p in kept], shape, problem


def _regular_grid(layout: Layout) -> tuple[int, ...] | None:
    """Megatron's `axis_fragmentations` when the distinct blocks form an even grid."""
    blocks = layout.distinct_blocks
    sizes = {b.sizes for b in blocks}
    if len(sizes) != 1:
        return None
    size = sizes.pop()
    if any(s == 0 or n % s for s, n in zip(size, layout.global_shape)):
        return None
    grid = tuple(n // s for s, n in zip(size, layout.global_shape))
    return grid if math.prod(grid) == len(blocks) else None


def _replica_id(layout: Layout, block: Block, rank: int) -> int:
    """0 for the lowest rank holding `block`, 1 for the next, ... (only 0 is saved)."""
    holders = sorted(layout.ranks_holding(block))
    return holders.index(rank) if rank in holders else 0


def _megatron_pieces(key: str, st: ShardedTensor, prepend_axis_num: int) -> list[Any]:
    mapping = _mapping()
    layout = st.layout_spec
    grid = _regular_grid(layout)
    out = []
    for block, shard in zip(st.local_blocks, st._shards):
        lead = tuple(shard.shape[:prepend_axis_num])
        if any(s != 1 for s in lead):
            raise ShardMismatchError(
                f"key '{key}', rank {st.rank}: block {block} has leading sizes {lead}, not 1, so "
                f"prepend_axis_num={prepend_axis_num} cannot drop them"
            )
        data = shard.view(tuple(shard.shape[prepend_axis_num:]))
        out.append(
            mapping.ShardedTensor(
                key,
                data,
                data.dtype,
                tuple(data.shape),
                tuple(layout.global_shape),
                tuple(block.offsets),
                grid,
                _replica_id(layout, block, st.rank),
                prepend_axis_num,
            )
        )
    return out


def to_megatron(
    state_dict: Mapping[str, ShardedTensor], *, prepend_axis_num: Mapping[str, int] | int = 0
) -> dict[str, Any]:
    """Megatron ShardedTensors over the same storage: key -> piece, or list of pieces.

    No communication. Each local block becomes one piece (keyed by its dict
    key), `replica_id` numbering the ranks that hold the same block, and
    `axis_fragmentations` set when the layout is an even grid (else None: uneven).
    A rank holding no block of a key gets no entry for it (Megatron would take an
    empty list for common state). `prepend_axis_num` (per key or for all) drops
    that many leading size-1 axes from the local data, as Megatron's layer stacking does.
    """
    out: dict[str, Any] = {}
    for key, st in state_dict.items():
        if not isinstance(st, ShardedTensor):
            raise InvalidTypeError(
                f"'{key}' is a {type(st).__name__}, not a shardwise ShardedTensor"
            )
        n = prepend_axis_num if isinstance(prepend_axis_num, int) else prepend_axis_num.get(key, 0)
        pieces = _megatron_pieces(key, st, n)
        if pieces:
            out[key] = pieces[0] if len(pieces) == 1 else pieces
    return out


def is_mcore_value(value: Any) -> bool:
    """A Megatron ShardedTensor, CheckpointableShardedTensor or LocalShardsContainer."""
    return is_mcore_piece(value) or _is_wrapper(value)


def is_mapping_class(value: Any, name: str) -> bool:
    """`value` is an instance of `dist_checkpointing.mapping.<name>`."""
    return type(value).__module__ == _MAPPING and type(value).__name__ == name
