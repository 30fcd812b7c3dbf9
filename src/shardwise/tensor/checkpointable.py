"""DCP's view of a `ShardedTensor`: its chunks, and the `_Checkpointable` protocol.

`dcp.save` / `dcp.load` call these hooks to plan a tensor's writes and reads
per chunk; the code is in `dcp_hooks`, which needs only DCP's metadata types.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from . import dcp_hooks

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import WriteItem

    from .sharded import ShardedTensor

__all__ = ["Checkpointable"]


class Checkpointable:
    """`ShardedTensor`'s DCP chunks and `_Checkpointable` hooks."""

    __slots__ = ()

    @property
    def local_chunks(self) -> list[ChunkStorageMetadata]:
        """DCP chunks of this rank's blocks, in local-shard order."""
        return dcp_hooks.chunks_of(_sharded(self).local_blocks)

    def storage_metadata(self) -> TensorStorageMetadata:
        """DCP's description of this tensor: global size, this rank's chunks."""
        return dcp_hooks.storage_metadata(_sharded(self))

    def __create_write_items__(
        self, fqn: str, object: Any, index: int | None = None
    ) -> list[WriteItem]:
        # `index`: a container's hint, its position in it (Megatron's LocalShardsContainer)
        return dcp_hooks.create_write_items(_sharded(self), fqn, index)

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return dcp_hooks.create_chunk_list(_sharded(self))

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return dcp_hooks.get_tensor_shard(_sharded(self), index)


def _sharded(hooks: Checkpointable) -> ShardedTensor:
    """The tensor these hooks belong to: `Checkpointable` is only ever its base."""
    return cast("ShardedTensor", hooks)
