"""DTensor (a plain local tensor, or torch's `LocalShardsWrapper`) in checkpoints.

Described in place (`engine.inventory.ValueAdapter.pieces`): the engine reads and
writes each rank's local boxes where they are, found from the DTensor's own
placements, with no conversion and nothing collective; a rank outside the
DTensor's mesh holds nothing.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import DTensor
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..engine import Piece, ValueAdapter, is_plain_tensor, register_value_adapter

__all__: list[str] = []


def _pieces(value: Any) -> list[Piece] | None:
    """This rank's boxes of `value`; None when its local tensor is itself a subclass
    the engine does not know (left to DCP's per-item machinery)."""
    local = value._local_tensor
    if isinstance(local, LocalShardsWrapper):
        return [
            Piece(shard, tuple(offsets), tuple(shard.shape))
            for shard, offsets in zip(local.local_shards(), local.local_offsets())
        ]
    if not is_plain_tensor(local):
        return None
    if value.device_mesh.get_coordinate() is None:  # this rank is not in the mesh
        return []
    sizes, offsets = compute_local_shape_and_global_offset(
        value.shape, value.device_mesh, value.placements
    )
    return [Piece(local, tuple(offsets), tuple(sizes))]


register_value_adapter(ValueAdapter("dtensor", DTensor, pieces=_pieces))
