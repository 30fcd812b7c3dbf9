"""Differentiable `from_local` / `to_local`, as DTensor's: one block per rank.

The PhysicsNeMo-style shortcut `from_local(tensor, dim, sharding_shapes=...)`
builds the layout from each rank's piece along one dimension: "chunk" checks
the pieces are `torch.chunk` sizes, "infer" accepts any sizes (both gather
the sizes, one small collective), and an explicit list needs no communication.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..errors import LayoutError, ShardMismatchError
from ..layout import Layout
from ..tensor import ShardedTensor
from .agreement import exchange

__all__ = ["from_local", "to_local"]


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, layout: Layout, rank: int, group: Any) -> ShardedTensor:
        ctx.shape = tensor.shape
        holds = bool(layout.blocks_of(rank))
        # view_as: the output must not be the input object itself (as in DTensor).
        shards = [tensor.view_as(tensor)] if holds else []
        return ShardedTensor(layout, shards, rank, dtype=tensor.dtype, device=tensor.device, group=group)

    @staticmethod
    def backward(ctx: Any, grad: ShardedTensor) -> tuple[torch.Tensor, None, None, None]:
        shards = grad.local_shards()
        if not shards:
            return torch.zeros(ctx.shape, dtype=grad.dtype, device=grad.device), None, None, None
        return shards[0], None, None, None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, st: ShardedTensor) -> torch.Tensor:
        ctx.layout, ctx.rank, ctx.group = st.layout_spec, st.rank, st.group
        shards = st.local_shards()
        if len(shards) > 1:
            raise ValueError(
                f"rank {st.rank} holds {len(shards)} blocks; to_local() needs one, "
                f"use local_shards() for several"
            )
        if not shards:
            return torch.empty((0,) * max(st.dim(), 1), dtype=st.dtype, device=st.device)
        return shards[0].view_as(shards[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> ShardedTensor:
        shards = [grad] if ctx.layout.blocks_of(ctx.rank) else []
        return ShardedTensor(ctx.layout, shards, ctx.rank, dtype=grad.dtype, device=grad.device, group=ctx.group)


def to_local(st: ShardedTensor) -> torch.Tensor:
    """This rank's single shard (an empty tensor on a rank holding none). Differentiable."""
    return _ToLocal.apply(st)


def from_local(
    tensor: torch.Tensor,
    layout: Layout | int,
    sharding_shapes: str | Sequence[int] = "infer",
    *,
    group: Any = None,
) -> ShardedTensor:
    """Wrap this rank's one block; differentiable like `DTensor.from_local`.

    `layout` is a `Layout` (no communication) or the dimension along which
    the ranks' tensors are consecutive pieces, with `sharding_shapes` "chunk",
    "infer" or an explicit list of per-rank sizes along that dimension.
    """
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    if isinstance(layout, Layout):
        blocks = layout.blocks_of(rank)
        if len(blocks) > 1:
            raise ShardMismatchError(
                f"rank {rank} holds {len(blocks)} blocks; from_local takes one tensor per "
                f"rank, use ShardedTensor.from_layout for several"
            )
        expected = blocks[0].sizes if blocks else None
        if expected is not None and tuple(tensor.shape) != expected:
            raise ShardMismatchError(
                f"rank {rank}: the tensor has shape {tuple(tensor.shape)} but its block "
                f"{blocks[0]} has sizes {expected}"
            )
        if expected is None and tensor.numel():
            raise ShardMismatchError(f"rank {rank} holds no block but was given {tensor.numel()} elements")
        return _FromLocal.apply(tensor, layout, rank, group)
    return _FromLocal.apply(tensor, _layout_along(tensor, int(layout), sharding_shapes, group), rank, group)


def _layout_along(tensor: torch.Tensor, dim: int, sharding_shapes: Any, group: Any) -> Layout:
    if not -tensor.dim() <= dim < max(tensor.dim(), 1):
        raise ValueError(f"dimension {dim} is out of range for a {tensor.dim()}-d tensor")
    dim %= tensor.dim()
    shape = tuple(tensor.shape)
    if isinstance(sharding_shapes, str):
        if sharding_shapes not in ("chunk", "infer"):
            raise ValueError(f"sharding_shapes must be 'chunk', 'infer' or a list of sizes, got {sharding_shapes!r}")
        others = shape[:dim] + shape[dim + 1 :]
        everyone = exchange(None, (shape[dim], others), group)
        sizes = [s for s, _ in everyone]
        if any(o != others for _, o in everyone):
            raise ShardMismatchError(
                f"ranks' tensors differ outside dimension {dim}: "
                f"{[o for _, o in everyone]}"
            )
        if sharding_shapes == "chunk":
            total = sum(sizes)
            chunked = Layout.chunked((total,), 0, len(sizes))
            expected = [bs[0].sizes[0] if bs else 0 for bs in chunked.blocks]
            if sizes != expected:
                raise LayoutError(
                    f"pieces along dimension {dim} have sizes {sizes}, not torch.chunk's "
                    f"{expected}; use sharding_shapes='infer'"
                )
    else:
        sizes = [int(s) for s in sharding_shapes]
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if len(sizes) != world:
        raise ShardMismatchError(f"{len(sizes)} sizes for {world} ranks")
    global_shape = shape[:dim] + (sum(sizes),) + shape[dim + 1 :]
    return Layout.along(global_shape, dim, sizes, world_size=world)
