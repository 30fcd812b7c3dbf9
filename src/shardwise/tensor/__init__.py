"""The tensor type: `ShardedTensor`, its DCP hooks, and the table through which
the layers above (comm, interop, ops) supply its collective methods."""

from __future__ import annotations

from .construction import learned
from .sharded import ShardedTensor
from .sharded import _rebuild as _rebuild  # where pickles of shardwise <= 0.1 look for it

__all__ = ["ShardedTensor", "learned"]
