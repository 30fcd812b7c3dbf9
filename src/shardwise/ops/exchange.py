"""What an op's rule moves between ranks: operands into a layout, partial results summed.

Rules run inside `__torch_dispatch__`, below autograd, on every rank of the
tensor's group in the same order (SPMD), so they call the raw collectives
(`shardwise.comm.transfer.move`, `torch.distributed.all_reduce` on the
tensor's group) and never the agreement exchanges of the public collectives:
the layouts were agreed when the operands were built.

Costs per rank, with S the bytes of the tensor and W the group size:
`local_in(st, layout)` moves only the elements this rank lacks (nothing when
`st` is replicated or already in `layout`); `whole(st)` receives S minus what
the rank holds; `all_reduce` of an O-byte partial result moves about 2·O.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from ..comm.transfer import move
from ..errors import UsageError
from ..layout import Block, Layout
from ..tensor import ShardedTensor

__all__ = [
    "all_reduce",
    "broadcast",
    "is_replicated",
    "local_in",
    "primary_blocks",
    "replicated",
    "whole",
    "whole_or_plain",
]


@functools.lru_cache(maxsize=4096)
def is_replicated(layout: Layout) -> bool:
    """Every rank holds the whole tensor as one block."""
    whole_block = Block((0,) * layout.ndim, layout.global_shape)
    return all(blocks == (whole_block,) for blocks in layout.blocks)


@functools.lru_cache(maxsize=4096)
def replicated(shape: tuple[int, ...], world_size: int) -> Layout:
    return Layout.replicated(shape, world_size)


def local_in(st: ShardedTensor, layout: Layout) -> list[torch.Tensor]:
    """This rank's shards of `layout` holding `st`'s values (views where no data moves)."""
    if st._layout == layout:
        return st._shards
    if is_replicated(st._layout):
        full = st._shards[0]
        return [full[b.slices()] for b in layout.blocks_of(st._rank)]
    _distributed(st)  # refuses a many-rank layout with no process group
    return move(st, layout, checked=True)


def whole(st: ShardedTensor) -> torch.Tensor:
    """The whole tensor on this rank (this rank's own shard when already replicated)."""
    if is_replicated(st._layout):
        return st._shards[0]
    _distributed(st)  # refuses a many-rank layout with no process group
    (full,) = move(st, replicated(tuple(st.shape), st._layout.world_size), checked=True)
    return full


def whole_or_plain(x: Any) -> Any:
    """A ShardedTensor operand whole on this rank; anything else (a plain tensor, None) as is."""
    return whole(x) if isinstance(x, ShardedTensor) else x


def primary_blocks(layout: Layout, rank: int) -> list[int]:
    """Indices of this rank's blocks it is the first holder of: summing those over the
    ranks counts every element once, replicas included."""
    return [
        i
        for i, block in enumerate(layout.blocks_of(rank))
        if layout.ranks_holding(block)[0] == rank
    ]


def _distributed(st: ShardedTensor) -> bool:
    """Whether `st`'s group has other ranks; a layout over several ranks with no process
    group to reach them is refused (its other ranks' values would silently be missing)."""
    if st._layout.world_size == 1:
        return False
    if not (dist.is_available() and dist.is_initialized()):
        raise UsageError(
            f"rank {st._rank}: this op combines the values of all {st._layout.world_size} ranks "
            f"of the tensor's layout, which needs a process group; none is initialised "
            f"(torch.distributed.init_process_group)"
        )
    return True


def all_reduce(tensor: torch.Tensor, op: Any, like: ShardedTensor) -> torch.Tensor:
    """`tensor` reduced with `op` (a `dist.ReduceOp`) over `like`'s group, in place."""
    if _distributed(like):
        dist.all_reduce(tensor, op=op, group=like.group)
    return tensor


def broadcast(tensor: torch.Tensor, like: ShardedTensor) -> torch.Tensor:
    """Group rank 0's `tensor` on every rank of `like`'s group, in place."""
    if _distributed(like):
        src = 0 if like.group is None else dist.get_global_rank(like.group, 0)
        dist.broadcast(tensor, src=src, group=like.group)
    return tensor
