"""Conversions between ShardedTensor and the sharded types of PyTorch and its users.

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
from .scatter import scatter_tensor

__all__ = [
    "from_dtensor",
    "from_shard_tensor",
    "from_torch_sharded_tensor",
    "scatter_tensor",
    "to_dtensor",
    "to_shard_tensor",
]

provide(to_dtensor=to_dtensor, to_shard_tensor=to_shard_tensor)
provide(
    gather_into=legacy.gather_into,
    local_tensor=legacy.local_tensor,
    metadata=legacy.metadata,
    reshard=legacy.reshard,
    sharding_spec=legacy.sharding_spec,
    to_torch_sharded_tensor=legacy.to_torch_sharded_tensor,
)
