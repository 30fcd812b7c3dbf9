"""Conversions with PyTorch's sharded types: DTensor (with or without
LocalShardsWrapper inside) and the legacy `torch.distributed._shard` ShardedTensor.

Shard data is never copied: the ShardedTensor holds the very local tensors
of its source, and `to_dtensor` hands its shard to `DTensor.from_local`.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..dist.build import _from_local_shards
from ..errors import LayoutError
from ..layout import Block, Layout
from ..tensor import ShardedTensor

__all__ = ["from_dtensor", "from_torch_sharded_tensor", "to_dtensor"]


def _mesh_position(mesh: Any) -> int:
    """This rank's row-major position in `mesh`, which must list the world's ranks in order."""
    ranks = mesh.mesh.flatten().tolist()
    if ranks != list(range(dist.get_world_size())):
        raise LayoutError(
            f"the device mesh lists ranks {ranks}; shardwise maps mesh positions to "
            f"ranks of the default group, so the mesh must hold ranks 0..N-1 in order"
        )
    return dist.get_rank()


def from_dtensor(dt: DTensor) -> ShardedTensor:
    """The same data as a ShardedTensor. Local unless the local tensor is a
    LocalShardsWrapper, whose blocks only it knows: then collective."""
    local = dt._local_tensor
    if isinstance(local, LocalShardsWrapper):
        problem = None
        try:
            _mesh_position(dt.device_mesh)
        except LayoutError as e:  # raised after the exchange, on every rank, not here alone
            problem = e
        shards = local.local_shards()
        offsets = local.local_offsets() if shards else []  # an empty wrapper reports one fake chunk
        return _from_local_shards(shards, [tuple(o) for o in offsets], tuple(dt.shape), None, problem)
    position = _mesh_position(dt.device_mesh)
    layout = Layout.from_dtensor_spec(dt.device_mesh.shape, dt.placements, tuple(dt.shape))
    blocks = layout.blocks_of(position)
    if blocks and tuple(local.shape) != blocks[0].sizes:
        raise LayoutError(
            f"rank {position}: the DTensor's local tensor has shape {tuple(local.shape)} but "
            f"torch.chunk sharding gives {blocks[0].sizes}; unevenly built DTensors are not supported"
        )
    return ShardedTensor(
        layout, [local] if blocks else [], position, dtype=dt.dtype, device=local.device
    )


def to_dtensor(st: ShardedTensor, mesh: Any, placements: Sequence[Any]) -> DTensor:
    """A DTensor over `mesh` sharing this rank's shard; the layout must be what
    `placements` produce (`Layout.from_dtensor_spec`), otherwise `LayoutError`."""
    expected = Layout.from_dtensor_spec(mesh.shape, placements, tuple(st.shape))
    if expected != st.layout_spec:
        raise LayoutError(
            f"{st.layout_spec} cannot be expressed as placements {tuple(placements)} on a "
            f"mesh of shape {tuple(mesh.shape)} (they give {expected}); redistribute first"
        )
    _mesh_position(mesh)
    shards = st.local_shards()
    if shards:
        local = shards[0]
    else:
        sizes, _ = compute_local_shape_and_global_offset(st.shape, mesh, placements)
        local = torch.empty(sizes, dtype=st.dtype, device=st.device)
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=st.shape, stride=_contiguous_stride(st.shape)
    )


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def from_torch_sharded_tensor(legacy: Any) -> ShardedTensor:
    """The legacy `torch.distributed._shard` ShardedTensor as a ShardedTensor.

    Its global metadata already lists every shard's rank, so no communication.
    """
    md = legacy.metadata()
    group = getattr(legacy, "_process_group", None)
    blocks: dict[int, list[Block]] = {}
    for shard_md in md.shards_metadata:
        rank = shard_md.placement.rank()
        blocks.setdefault(rank, []).append(Block(shard_md.shard_offsets, shard_md.shard_sizes))
    world = dist.get_world_size(group)
    layout = Layout(tuple(md.size), blocks, world)
    rank = dist.get_rank(group)
    by_offset = {tuple(s.metadata.shard_offsets): s.tensor for s in legacy.local_shards()}
    shards = [by_offset[b.offsets] for b in layout.blocks_of(rank)]
    device = shards[0].device if shards else torch.device("cpu")
    return ShardedTensor(
        layout, shards, rank, dtype=md.tensor_properties.dtype, device=device, group=group
    )
