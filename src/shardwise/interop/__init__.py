"""Conversions between ShardedTensor and the sharded types of PyTorch and its users.

`placements`: DTensor's surface (`device_mesh`, `placements`, `redistribute(mesh,
placements)`, `grad_placements=`, `from_local(local, mesh, placements)`);
`dtensor`: DTensor (plain or over LocalShardsWrapper) and the legacy
`torch.distributed._shard` ShardedTensor (`legacy`: its API and specs); `physicsnemo`: PhysicsNeMo's
ShardTensor; `megatron`: Megatron-Core's sharded tensors. None imports its
client library first: a value of its type in hand means the library is loaded.
Their checkpoint adapters are `shardwise.checkpoint`'s.
"""

from __future__ import annotations

from ..tensor.provided import provide
from . import legacy
from .dtensor import from_dtensor, from_torch_sharded_tensor, to_dtensor
from .physicsnemo import from_shard_tensor, to_shard_tensor
from .placements import (
    device_mesh,
    from_local,
    from_local_placements,
    grad_plan,
    mesh_offsets,
    placements,
    redistribute_placements,
)
from .scatter import scatter_tensor

__all__ = [
    "from_dtensor",
    "from_local",
    "from_shard_tensor",
    "from_torch_sharded_tensor",
    "scatter_tensor",
    "to_dtensor",
    "to_shard_tensor",
]

provide(to_dtensor=to_dtensor, to_shard_tensor=to_shard_tensor)
provide(
    device_mesh=device_mesh,
    from_local_placements=from_local_placements,
    grad_plan=grad_plan,
    mesh_offsets=mesh_offsets,
    placements=placements,
    redistribute_placements=redistribute_placements,
)
provide(
    gather_into=legacy.gather_into,
    local_tensor=legacy.local_tensor,
    metadata=legacy.metadata,
    reshard=legacy.reshard_method,
    sharding_spec=legacy.sharding_spec,
    to_torch_sharded_tensor=legacy.to_torch_sharded_tensor,
)
