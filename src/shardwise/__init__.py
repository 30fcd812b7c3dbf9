"""shardwise: tensors split into any blocks over ranks, and checkpoints that reshard.

The public surface is what `__all__` lists; everything else is internal.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from .comm import distribute, equal
from .errors import (
    ArgumentMismatchError,
    CheckpointBusyError,
    CheckpointExistsError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    InvalidArgumentError,
    InvalidTypeError,
    LayoutError,
    RankFailureError,
    RankTimeoutError,
    ShardCountError,
    ShardMismatchError,
    ShardwiseError,
    SingleShardError,
    UnsafeMetadataError,
    UnsupportedStorageError,
    UsageError,
)
from .interop import (
    from_dtensor,
    from_local,
    from_shard_tensor,
    from_torch_sharded_tensor,
    scatter_tensor,
)
from .layout import Block, Layout, Transfer, plan_transfers
from .ops import register_dispatch_handler, register_op, unregister_op
from .tensor import ShardedTensor
from .tensor.sharded import (
    register_function_handler,
    register_named_function_handler,
    unregister_function_handler,
)

try:
    __version__ = version("shardwise")
except PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "0+unknown"

__all__ = [
    "ArgumentMismatchError",
    "Block",
    "CheckpointBusyError",
    "CheckpointExistsError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "InvalidArgumentError",
    "InvalidTypeError",
    "Layout",
    "LayoutError",
    "RankFailureError",
    "RankTimeoutError",
    "ShardCountError",
    "ShardMismatchError",
    "ShardedTensor",
    "ShardwiseError",
    "SingleShardError",
    "Transfer",
    "UnsafeMetadataError",
    "UnsupportedStorageError",
    "UsageError",
    "__version__",
    "distribute",
    "equal",
    "from_dtensor",
    "from_local",
    "from_shard_tensor",
    "from_torch_sharded_tensor",
    "plan_transfers",
    "register_dispatch_handler",
    "register_function_handler",
    "register_named_function_handler",
    "register_op",
    "scatter_tensor",
    "unregister_function_handler",
    "unregister_op",
]
