"""Checkpointing ShardedTensors through `torch.distributed.checkpoint` (DCP).

`protocol` implements DCP's `_Checkpointable` hooks, so stock `dcp.save` and
`dcp.load` accept a `ShardedTensor` with no other help.
"""

from __future__ import annotations

from ..errors import CorruptCheckpointError, IncompleteCheckpointError, LayoutError

__all__ = ["CorruptCheckpointError", "IncompleteCheckpointError", "LayoutError"]
