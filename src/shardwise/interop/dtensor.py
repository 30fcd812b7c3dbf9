"""Conversions with PyTorch's sharded types: DTensor (with or without
LocalShardsWrapper inside) and the legacy `torch.distributed._shard` ShardedTensor.

Shard data is never copied: the ShardedTensor holds the very local tensors
of its source, and `to_dtensor` hands its shard to `DTensor.from_local`, or,
where a rank holds several blocks, its shards in a `LocalShardsWrapper` (as
TorchRec builds them).

`from_dtensor` (and `from_shard_tensor`) is collective: see `interop.agreed`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..comm.build import from_local_shards_checked
from ..errors import LayoutError
from ..layout import Block, Layout
from ..tensor import ShardedTensor
from ..tensor.construction import PendingLayout
from .agreed import (
    DTENSOR,
    SHARD_TENSOR,
    WRAPPED,
    Inspection,
    base_meta,
    convert_agreed,
    mesh_position,
    shared_local,
)
from .physicsnemo import inspect_shard_tensor

__all__ = [
    "from_dtensor",
    "from_torch_sharded_tensor",
    "to_dtensor",
    "to_local_shards_wrapper",
]


def _inspect_dtensor(dt: DTensor) -> Inspection:
    """A plain DTensor: its layout follows from mesh, placements and shape; the
    local tensor must be what they give (DTensors built unevenly are refused)."""
    position = mesh_position(dt.device_mesh)
    local = dt._local_tensor
    layout = Layout.from_dtensor_spec(dt.device_mesh.shape, dt.placements, tuple(dt.shape))
    blocks = layout.blocks_of(position)
    expected = blocks[0].sizes if blocks else None
    if expected is not None and tuple(local.shape) != expected:
        raise LayoutError(
            f"its DTensor's local tensor has shape {tuple(local.shape)} but its placements "
            f"{tuple(dt.placements)} give {expected} (torch.chunk sizes); an unevenly built "
            f"DTensor has no layout shardwise can trust (for uneven pieces use "
            f"sw.from_local(local, dim, sharding_shapes='infer'))"
        )
    if expected is None and local.numel():
        raise LayoutError(
            f"its DTensor's placements give it no element but its local tensor has shape "
            f"{tuple(local.shape)}; an unevenly built DTensor has no layout shardwise can trust"
        )

    def finish(everyone: list[dict[str, Any]], group: Any, mesh: Any) -> ShardedTensor:
        out = shared_local(dt, layout, position, group, mesh)
        out._placements = tuple(dt.placements)
        return out

    return Inspection(base_meta(dt, DTENSOR), finish)


def _inspect_wrapped(dt: DTensor) -> Inspection:
    """A DTensor over LocalShardsWrapper: only the wrappers know the blocks, so
    `from_local_shards` learns them (a second exchange, on every rank alike)."""
    mesh_position(dt.device_mesh)
    local: LocalShardsWrapper = dt._local_tensor  # type: ignore[assignment]
    shards = local.local_shards()
    # an empty wrapper reports one fake chunk
    offsets = [tuple(o) for o in local.local_offsets()] if shards else []
    meta = base_meta(dt, WRAPPED)
    meta["key"] = (None, None, meta["key"][2])  # placements say nothing about the blocks here

    def finish(everyone: list[dict[str, Any]], group: Any, mesh: Any) -> ShardedTensor:
        # a wrapper may hold strided views (LocalShardsWrapper accepts them): kept, not copied
        out = from_local_shards_checked(shards, offsets, tuple(dt.shape), group, contiguous=False)
        out._mesh = mesh
        return out

    return Inspection(meta, finish)


def from_dtensor(dt: DTensor) -> ShardedTensor:
    """The same data as a ShardedTensor, sharing the local tensor(s). Collective.

    Takes a DTensor (any Shard / Replicate placements, evenly built, or over
    LocalShardsWrapper) or a PhysicsNeMo ShardTensor (see `from_shard_tensor`).
    The ranks exchange their metadata once and check the global layout: an
    unevenly built DTensor, ranks passing different meshes, placements, shapes
    or dtypes, or a value of another type raise the same error on every rank,
    naming the faulty rank.
    """
    return convert_agreed(
        dt,
        {DTENSOR: _inspect_dtensor, WRAPPED: _inspect_wrapped, SHARD_TENSOR: inspect_shard_tensor},
        "from_dtensor",
        "a DTensor (plain or over LocalShardsWrapper) or a PhysicsNeMo ShardTensor",
    )


def to_dtensor(st: ShardedTensor, mesh: Any, placements: Sequence[Any]) -> DTensor:
    """A DTensor over `mesh` sharing this rank's shards. No communication.

    Where every rank holds at most one block, the layout must be what
    `placements` produce (`Layout.from_dtensor_spec`), otherwise `LayoutError`,
    and the local tensor is the shard. Where some rank holds several blocks, or
    the layout is not learned yet (`from_local_blocks`), the local tensor is a
    `LocalShardsWrapper` of this rank's shards (`to_local_shards_wrapper`), as
    TorchRec builds them: `placements` are recorded as given (TorchRec's
    `Shard(1)` for column-wise, `Shard(0)` for row-wise) and the wrapper's
    offsets say where each shard lies; `sw.from_dtensor` reads it back.
    """
    # Which form is decided by the layout, the same on every rank (never by this
    # rank's own block count), and without learning a pending layout.
    layout = st._layout
    if (isinstance(layout, PendingLayout) and not layout.is_learned) or any(
        len(blocks) > 1 for blocks in layout.blocks
    ):
        return _wrapped_dtensor(st, mesh, placements)
    expected = Layout.from_dtensor_spec(mesh.shape, placements, tuple(st.shape))
    if expected != layout:
        raise LayoutError(
            f"{layout} cannot be expressed as placements {tuple(placements)} on a "
            f"mesh of shape {tuple(mesh.shape)} (they give {expected}); redistribute first"
        )
    mesh_position(mesh)
    # `_shards`, not `local_shards()`: a subclass may return legacy `Shard` objects there
    shards = st._shards
    if shards:
        local = shards[0]
    else:
        sizes, _ = compute_local_shape_and_global_offset(st.shape, mesh, placements)
        local = torch.empty(sizes, dtype=st.dtype, device=st.device)
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=st.shape, stride=contiguous_stride(st.shape)
    )


def to_local_shards_wrapper(st: ShardedTensor) -> LocalShardsWrapper:
    """This rank's shards, the very tensors, in torch's `LocalShardsWrapper` with their
    global offsets. Local: no communication, the layout is not learned.

    Blocks with no element are left out: DCP keys a chunk by its offsets, so an
    empty chunk at another rank's block offsets would replace that block in the
    save plan (`dedup_save_plans`); our own DCP hooks leave them out alike."""
    held = [(b, s) for b, s in zip(st.local_blocks, st._shards) if not b.is_empty()]
    return LocalShardsWrapper([s for _, s in held], [b.offsets for b, _ in held])


def _wrapped_dtensor(st: ShardedTensor, mesh: Any, placements: Sequence[Any]) -> DTensor:
    mesh_position(mesh)
    if len(tuple(placements)) != mesh.ndim:
        raise LayoutError(
            f"{len(tuple(placements))} placements {tuple(placements)} for a {mesh.ndim}-d "
            f"mesh; give one per mesh dimension"
        )
    return DTensor.from_local(
        to_local_shards_wrapper(st),
        mesh,
        placements,
        run_check=False,
        shape=st.shape,
        stride=contiguous_stride(st.shape),
    )


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def from_torch_sharded_tensor(legacy: Any) -> ShardedTensor:
    """The legacy `torch.distributed._shard` ShardedTensor as a ShardedTensor.

    Its global metadata already lists every shard's rank, so no communication.
    Empty shards (a chunk spec's chunks past the end of the tensor) are left out.
    On a subgroup, its placements' global ranks become the group's ranks.
    """
    md = legacy.metadata()
    group = getattr(legacy, "_process_group", None)
    blocks: dict[int, list[Block]] = {}
    for shard_md in md.shards_metadata:
        if 0 in shard_md.shard_sizes:
            continue
        rank = shard_md.placement.rank()
        if group is not None:
            rank = dist.get_group_rank(group, rank)
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
