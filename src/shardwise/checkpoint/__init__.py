"""Checkpointing sharded state through `torch.distributed.checkpoint` (DCP)::

    import shardwise.checkpoint as swc
    swc.save(state_dict, "ckpt/step_100")        # collective
    fut = swc.async_save(state_dict, "ckpt/step_200")  # returns after staging
    swc.load(state_dict, "ckpt/step_100")        # collective, in place, any layout
    swc.CheckpointManager("ckpt", keep_last=3)   # step folders, latest(), restore, retention
    swc.init_optimizer_state(optimizer)          # before a load: state for it to fill
    t = swc.read_tensor("ckpt/step_100", "emb.weight", region=Block((0, 0), (10, 256)))

The format is a DCP checkpoint (stock `dcp.load` reads it) plus `shardwise.json`;
`Writer` / `Reader` plug into `dcp.save` / `dcp.load` directly.
"""

from __future__ import annotations

from ..errors import (
    ArgumentMismatchError,
    CheckpointBusyError,
    CheckpointExistsError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    InvalidArgumentError,
    LayoutError,
    UnsafeMetadataError,
    UnsupportedStorageError,
)
from . import clients  # noqa: F401  (importing registers the clients' value adapters)
from .api import LoadInfo, SaveFuture, SaveInfo, async_save, load, read_tensor, save
from .dcp import Reader, Writer
from .format import allow_object_globals
from .manager import CheckpointManager
from .offline import (
    CheckpointInfo,
    OpenCheckpoint,
    TensorInfo,
    convert,
    inspect,
    open_checkpoint,
    reshard,
    verify,
)
from .optimizer import init_optimizer_state

__all__ = [
    "ArgumentMismatchError",
    "CheckpointBusyError",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "InvalidArgumentError",
    "LayoutError",
    "LoadInfo",
    "OpenCheckpoint",
    "Reader",
    "SaveFuture",
    "SaveInfo",
    "TensorInfo",
    "UnsafeMetadataError",
    "UnsupportedStorageError",
    "Writer",
    "allow_object_globals",
    "async_save",
    "convert",
    "init_optimizer_state",
    "inspect",
    "load",
    "open_checkpoint",
    "read_tensor",
    "reshard",
    "save",
    "verify",
]
