"""DCP's `_Checkpointable` hooks for `ShardedTensor`.

DCP asks three questions of a tensor it saves or loads: which chunks do you
write (`__create_write_items__`), which chunks do you want filled
(`__create_chunk_list__`), and which local tensor is chunk X
(`__get_tensor_shard__`). Blocks with no element are left out of both lists:
DCP has nothing to store or fill for them, and its coverage check counts
volumes. A write item's `index.index` is the block's position in the rank's
block list, so lookups take the fast path.

Blocks are in global coordinates whatever the tensor's group: the copies of a
block on several ranks (the DP copies of a tensor on a TP subgroup) have the same
`MetadataIndex` (key, offsets; the position is not compared), so DCP's planner
(`dedup_save_plans`) writes each once, and any layout loads them back.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..errors import ShardMismatchError
from ..layout import Block

if TYPE_CHECKING:
    from .sharded import ShardedTensor

__all__ = [
    "chunks_of",
    "create_chunk_list",
    "create_write_items",
    "get_tensor_shard",
    "storage_metadata",
]


def _chunk(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))


def chunks_of(blocks: Iterable[Block]) -> list[ChunkStorageMetadata]:
    """One DCP chunk per block, empty blocks included (LocalShardsWrapper's `local_chunks`)."""
    return [_chunk(b.offsets, b.sizes) for b in blocks]


def storage_metadata(st: ShardedTensor) -> TensorStorageMetadata:
    properties = TensorProperties(
        dtype=st.dtype, requires_grad=st.requires_grad, pin_memory=st.is_pinned()
    )
    return TensorStorageMetadata(properties=properties, size=st.shape, chunks=st.local_chunks)


def create_write_items(st: ShardedTensor, fqn: str, hint: int | None = None) -> list[WriteItem]:
    """One write item per distinct non-empty block, its `MetadataIndex.index` the block's
    position, or a container's `hint` (the tensor's position in it) where the tensor
    holds one block: `get_tensor_shard` finds the block by offset either way."""
    properties = TensorProperties(dtype=st.dtype, requires_grad=st.requires_grad)
    size = st.shape  # the global shape, known locally (a layout may not be learned yet)
    if st.pending_reduce is not None:
        # every rank plans every value, in one order; only the writer reads it later
        st._shards  # noqa: B018 - combined here, collectively
    items = []
    seen = set()
    blocks = st.local_blocks
    for i, block in enumerate(blocks):
        if block.is_empty() or block in seen:  # a block listed twice is written once
            continue
        seen.add(block)
        position = hint if hint is not None and len(blocks) == 1 else i
        items.append(
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(block.offsets), position),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=_chunk(block.offsets, block.sizes),
                    properties=properties,
                    size=size,
                ),
            )
        )
    return items


def create_chunk_list(st: ShardedTensor) -> list[ChunkStorageMetadata]:
    return [_chunk(b.offsets, b.sizes) for b in st.local_blocks if not b.is_empty()]


def get_tensor_shard(st: ShardedTensor, index: MetadataIndex) -> torch.Tensor:
    """The live shard at `index.offset`, probing `index.index` first. An index without
    an offset (a container asking its element, as Megatron's do) names the tensor's
    only non-empty block, or the one at `index.index`."""
    blocks = st.local_blocks
    shards = st._shards  # not local_shards(): a subclass may return legacy `Shard` objects
    offset = tuple(index.offset) if index.offset is not None else None
    hint = index.index
    if offset is None:
        held = [i for i, block in enumerate(blocks) if not block.is_empty()]
        if len(held) == 1:
            return shards[held[0]]
        if hint is not None and hint in held:
            return shards[hint]
        raise ShardMismatchError(
            f"an index of '{index.fqn}' without offsets names no block of rank {st.rank}: it "
            f"holds {len(held)} (its blocks: {', '.join(map(str, blocks)) or 'none'})"
        )
    if hint is not None and 0 <= hint < len(blocks) and blocks[hint].offsets == offset:
        if not blocks[hint].is_empty():
            return shards[hint]
    if offset is not None:
        for block, shard in zip(blocks, shards):
            if block.offsets == offset and not block.is_empty():
                return shard
    raise ShardMismatchError(
        f"rank {st.rank} holds no block at offsets {offset} of '{index.fqn}' "
        f"(its blocks: {', '.join(map(str, blocks)) or 'none'})"
    )
