"""Checkpoints in one process, with no process group: open, inspect, verify,
convert and reshard.
"""

from .conversion import TARGETS, convert
from .inspection import CheckpointInfo, TensorInfo, describe_sharding, inspect
from .opening import OpenCheckpoint, open_checkpoint
from .resharding import reshard
from .verification import verify

__all__ = [
    "CheckpointInfo",
    "OpenCheckpoint",
    "TARGETS",
    "TensorInfo",
    "convert",
    "describe_sharding",
    "inspect",
    "open_checkpoint",
    "reshard",
    "verify",
]
