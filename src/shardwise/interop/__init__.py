"""Conversions between ShardedTensor and the sharded types of PyTorch and its users.

`dtensor`: DTensor (plain or over LocalShardsWrapper) and the legacy
`torch.distributed._shard` ShardedTensor. `physicsnemo` and `megatron`: the
client libraries' types; those modules import their library only when called.
"""

from __future__ import annotations

from .dtensor import from_dtensor, from_torch_sharded_tensor, to_dtensor

__all__ = ["from_dtensor", "from_torch_sharded_tensor", "to_dtensor"]
