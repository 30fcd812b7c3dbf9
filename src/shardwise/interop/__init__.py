"""Conversions between ShardedTensor and the sharded types of PyTorch and its users.

`dtensor`: DTensor (plain or over LocalShardsWrapper) and the legacy
`torch.distributed._shard` ShardedTensor. `physicsnemo` and `megatron`: the
client libraries' types; those modules import their library only when called,
and are themselves imported only on first use (they register checkpoint
adapters, which `import shardwise` does not load).
"""

from __future__ import annotations

from typing import Any

from ..tensor import ShardedTensor
from .dtensor import from_dtensor, from_torch_sharded_tensor, to_dtensor

__all__ = ["from_dtensor", "from_shard_tensor", "from_torch_sharded_tensor", "to_dtensor"]


def from_shard_tensor(st: Any) -> ShardedTensor:
    """PhysicsNeMo's ShardTensor as a ShardedTensor sharing its local tensor. Collective.

    See `shardwise.interop.physicsnemo.from_shard_tensor`.
    """
    from .physicsnemo import from_shard_tensor as convert

    return convert(st)
