"""The legacy `torch.distributed._shard.sharded_tensor` API, for code moving to shardwise.

Replace `from torch.distributed._shard import sharded_tensor` with
`from shardwise import legacy as sharded_tensor`: the creation helpers take a
`ChunkShardingSpec` / `EnumerableShardingSpec` and sizes as before and return
a `shardwise.ShardedTensor`, whose methods `sharding_spec()`, `metadata()`,
`local_tensor()`, `reshard(spec)` and `gather(dst, out=)` behave as the
legacy ones (`reshard` returns a new tensor). `to_sharding_spec(layout)` is the
way back from `Layout.from_sharding_spec` and lives here, not on `Layout`,
because building torch's spec classes imports `torch.distributed`, which the
layout layer never does. The code is in `shardwise.interop.legacy`.
"""

from __future__ import annotations

from .interop.dtensor import from_torch_sharded_tensor
from .interop.legacy import (
    empty,
    full,
    gather_into,
    local_tensor,
    metadata,
    ones,
    rand,
    reshard,
    sharding_spec,
    to_sharding_spec,
    to_torch_sharded_tensor,
    zeros,
)
from .interop.legacy_hooks import pre_load_state_dict_hook, state_dict_hook

__all__ = [
    "empty",
    "from_torch_sharded_tensor",
    "full",
    "gather_into",
    "local_tensor",
    "metadata",
    "ones",
    "pre_load_state_dict_hook",
    "rand",
    "reshard",
    "sharding_spec",
    "state_dict_hook",
    "to_sharding_spec",
    "to_torch_sharded_tensor",
    "zeros",
]
