"""shardwise: tensors split into any blocks over ranks, and checkpoints that reshard.

The public surface is what `__all__` lists; everything else is internal.
"""

from __future__ import annotations

from .comm import distribute, equal, from_local
from .errors import (
    CorruptCheckpointError,
    IncompleteCheckpointError,
    LayoutError,
    ShardMismatchError,
    ShardwiseError,
)
from .interop import from_dtensor, from_shard_tensor, from_torch_sharded_tensor, to_dtensor
from .layout import Block, Layout, Transfer, plan_transfers
from .ops import register_op
from .tensor import ShardedTensor

__version__ = "0.1.0"

__all__ = [
    "Block",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "Layout",
    "LayoutError",
    "ShardMismatchError",
    "ShardedTensor",
    "ShardwiseError",
    "Transfer",
    "__version__",
    "distribute",
    "equal",
    "from_dtensor",
    "from_local",
    "from_shard_tensor",
    "from_torch_sharded_tensor",
    "plan_transfers",
    "register_op",
    "to_dtensor",
]
