"""The legacy `torch.distributed._shard.sharded_tensor` API, for code moving to shardwise.

Replace `from torch.distributed._shard import sharded_tensor` with
`from shardwise import legacy as sharded_tensor` and the program runs unchanged:
`ShardedTensor` (a `shardwise.ShardedTensor` answering as the legacy class:
`local_shards()` as `Shard` objects, the spec it was built with, `reshard` in
place, legacy's exceptions), its constructors (`init_from_local_shards`,
`ShardedTensor._init_from_local_shards`, `_init_from_local_tensor`,
`_init_from_local_shards_and_global_metadata`), the creation helpers that take a
`ChunkShardingSpec` / `EnumerableShardingSpec`, `custom_sharded_op_impl` (into
torch's own op table), the state-dict hooks and the metadata classes.
`to_sharding_spec(layout)` is the way back from `Layout.from_sharding_spec`; it
lives here, not on `Layout`, because building torch's spec classes imports
`torch.distributed`, which the layout layer never does. Deliberate differences
are listed in `docs/migrating.md`. The code is in `shardwise.interop.legacy*`.
"""

from __future__ import annotations

from .interop.dtensor import from_torch_sharded_tensor
from .interop.legacy import (
    gather_into,
    local_tensor,
    metadata,
    reshard,
    sharding_spec,
    to_sharding_spec,
    to_torch_sharded_tensor,
)
from .interop.legacy_create import empty, full, ones, rand, randn, zeros
from .interop.legacy_hooks import pre_load_state_dict_hook, state_dict_hook
from .interop.legacy_tensor import (  # torch's own Shard and metadata classes
    Shard,
    ShardedTensor,
    ShardedTensorMetadata,
    ShardMetadata,
    TensorProperties,
    as_legacy,
    custom_sharded_op_impl,
    init_from_local_shards,
)

__all__ = [
    "Shard",
    "ShardMetadata",
    "ShardedTensor",
    "ShardedTensorMetadata",
    "TensorProperties",
    "as_legacy",
    "custom_sharded_op_impl",
    "empty",
    "from_torch_sharded_tensor",
    "full",
    "gather_into",
    "init_from_local_shards",
    "local_tensor",
    "metadata",
    "ones",
    "pre_load_state_dict_hook",
    "rand",
    "randn",
    "reshard",
    "sharding_spec",
    "state_dict_hook",
    "to_sharding_spec",
    "to_torch_sharded_tensor",
    "zeros",
]
