"""The legacy `torch.distributed._shard` ShardedTensor API on shardwise tensors.

Code written for torch 1.13's ShardedTensor (TorchRec, FBGEMM-era models,
their checkpoints) calls `sharding_spec()`, `metadata()`, `local_tensor()`,
`reshard(spec)`, `gather(dst, out=)` and the creation helpers that take a
spec. The methods are thin ones on `ShardedTensor` (a caller holds the
tensor), backed by the functions here; the creation helpers and the spec
bridge are functions (re-exported as `shardwise.legacy`; the creation helpers
are in `legacy_create`), because they take torch's spec types and would
otherwise crowd the type's own constructors.
Everything here needs `torch.distributed._shard`, so it sits in interop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard
from torch.distributed._shard.sharded_tensor import ShardedTensor as TorchShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)
from torch.distributed._shard.sharding_spec import (
    ChunkShardingSpec,
    EnumerableShardingSpec,
    ShardingSpec,
)
from torch.distributed.remote_device import _remote_device as RemoteDevice

from ..errors import InvalidArgumentError, LayoutError, ShardMismatchError, SingleShardError
from ..layout import Layout
from ..tensor import ShardedTensor

__all__ = [
    "gather_into",
    "local_tensor",
    "metadata",
    "reshard",
    "reshard_in_place",
    "reshard_method",
    "sharding_spec",
    "spec_layout",
    "to_sharding_spec",
    "to_torch_sharded_tensor",
]

DeviceOf = str | torch.device | Callable[[int], "str | torch.device"]


def _device_fn(device: DeviceOf | None) -> Callable[[int], str]:
    if device is None:
        return lambda rank: "cpu"
    if callable(device):
        return lambda rank: str(device(rank))
    return lambda rank: str(device)


def _chunk_spec(layout: Layout, place: Callable[[int], str]) -> ChunkShardingSpec | None:
    """The ChunkShardingSpec giving exactly `layout`, if one does."""
    holders = [r for r in range(layout.world_size) if layout.blocks_of(r)]
    if not holders or any(len(layout.blocks_of(r)) != 1 for r in holders):
        return None
    for dim in range(layout.ndim):
        ranks = sorted(holders, key=lambda r: layout.blocks_of(r)[0].offsets[dim])
        spec = ChunkShardingSpec(dim=dim, placements=[place(r) for r in ranks])
        try:
            if Layout.from_sharding_spec(spec, layout.global_shape, layout.world_size) == layout:
                return spec
        except LayoutError:
            continue
    return None


def to_sharding_spec(
    layout: Layout, device: DeviceOf | None = None, group: Any = None
) -> ShardingSpec:
    """A `ChunkShardingSpec` when the layout is `torch.chunk` along one dimension,
    else an `EnumerableShardingSpec`; placements `"rank:R/<device>"`.

    `device` is one device for every rank or a function of the rank (default
    cpu); ranks are translated from `group` to global ranks, as legacy
    placements are. Replicas and holes have no legacy spec: `LayoutError`.
    """
    if layout.replica_groups and any(len(h) > 1 for h in layout.replica_groups.values()):
        raise LayoutError(
            f"{layout} holds replicas; a legacy sharding spec has one owner per shard. "
            f"Redistribute to a layout without replicas first"
        )
    if not layout.is_fully_covered:
        raise LayoutError(f"{layout} has holes; a legacy sharding spec must cover the tensor")
    device_of = _device_fn(device)
    global_ranks = (
        list(dist.get_process_group_ranks(group))
        if group is not None
        else list(range(layout.world_size))
    )

    def place(rank: int) -> str:
        return f"rank:{global_ranks[rank]}/{device_of(rank)}"

    spec = _chunk_spec(layout, place)
    if spec is not None:
        return spec
    shards = [
        ShardMetadata(list(b.offsets), list(b.sizes), place(rank))
        for rank in range(layout.world_size)
        for b in layout.blocks_of(rank)
        if not b.is_empty()
    ]
    return EnumerableShardingSpec(shards)


def spec_layout(spec: ShardingSpec, shape: tuple[int, ...], world: int, group: Any) -> Layout:
    """The layout of a legacy spec on `group`: its placements name global ranks (as
    legacy ones do), which become the group's ranks (`LayoutError` for one outside it)."""
    if group is None or list(dist.get_process_group_ranks(group)) == list(range(world)):
        return Layout.from_sharding_spec(spec, shape, world)
    ranks = list(dist.get_process_group_ranks(group))

    def local(placement: Any) -> Any:
        if isinstance(placement, str):
            placement = RemoteDevice(placement)
        rank = placement.rank()
        if rank not in ranks:
            raise LayoutError(
                f"placement {placement} names global rank {rank}, which is not in the process "
                f"group of ranks {ranks}"
            )
        return RemoteDevice(f"rank:{ranks.index(rank)}/{placement.device()}")

    if isinstance(spec, ChunkShardingSpec):
        spec = ChunkShardingSpec(spec.dim, [local(p) for p in spec.placements])
    else:
        spec = EnumerableShardingSpec(
            [
                ShardMetadata(list(m.shard_offsets), list(m.shard_sizes), local(m.placement))
                for m in spec.shards  # type: ignore[attr-defined]
            ]
        )
    return Layout.from_sharding_spec(spec, shape, world)


def _devices(st: ShardedTensor) -> Callable[[int], str]:
    """This rank's own device; for the others, the same kind of device
    (`cuda:R` modulo the local device count for CUDA)."""
    own = st._shards[0].device if st._shards else st.device

    def device_of(rank: int) -> str:
        if rank == st.rank or own.type == "cpu":
            return str(own)
        count = torch.cuda.device_count() if own.type == "cuda" else 0
        return f"{own.type}:{rank % count}" if count else str(own)

    return device_of


def sharding_spec(st: ShardedTensor) -> ShardingSpec:
    """`st`'s layout as a legacy spec, its placements on `st`'s devices."""
    return to_sharding_spec(st.layout_spec, _devices(st), st.group)


def metadata(st: ShardedTensor, spec: ShardingSpec | None = None) -> ShardedTensorMetadata:
    """The legacy global metadata (every shard, its placement; tensor properties)."""
    spec = spec if spec is not None else sharding_spec(st)
    props = TensorProperties(
        dtype=st.dtype,
        layout=torch.strided,
        requires_grad=st.requires_grad,
        memory_format=torch.contiguous_format,
        pin_memory=st.is_pinned(),
    )
    return spec.build_metadata(torch.Size(st.shape), props)


def local_tensor(st: ShardedTensor) -> torch.Tensor:
    """The one live local shard; `SingleShardError` (a `NotImplementedError`, as legacy's)
    unless there is exactly one."""
    shards = st._shards
    if len(shards) != 1:
        raise SingleShardError(
            f"rank {st.rank} holds {len(shards)} shards of a tensor of shape "
            f"{tuple(st.shape)}; local_tensor() needs exactly one (use local_shards())"
        )
    return shards[0]


def to_torch_sharded_tensor(st: ShardedTensor, device: DeviceOf | None = None) -> Any:
    """A legacy ShardedTensor holding the very shard tensors of `st` (no copy,
    no communication: every rank knows the global layout)."""
    spec = to_sharding_spec(st.layout_spec, device or _devices(st), st.group)
    md = metadata(st, spec)
    shards = st._shards
    grad = any(s.requires_grad for s in shards)
    md.tensor_properties.requires_grad = grad
    own = f"rank:{dist.get_rank()}/"
    mine = [m for m in md.shards_metadata if str(m.placement).startswith(own)]
    for i, s in enumerate(shards):
        if not s.is_contiguous():
            raise ShardMismatchError(
                f"rank {st.rank}, shard {i} is not contiguous; the legacy ShardedTensor "
                f"accepts only contiguous shards (make them contiguous first)"
            )
    by_block = {(tuple(m.shard_offsets), tuple(m.shard_sizes)): m for m in mine}
    local = [Shard(s, by_block[(b.offsets, b.sizes)]) for s, b in zip(shards, st.local_blocks)]
    return TorchShardedTensor._init_from_local_shards_and_global_metadata(
        local, md, process_group=st.group, sharding_spec=spec
    )


def reshard(st: ShardedTensor, spec: ShardingSpec) -> ShardedTensor:
    """`st.reshard(spec)`: `st` in the layout of `spec`, in place, as legacy `reshard`
    (the tensor's shards are replaced and `st` returned; the data stays on `st`'s
    device). Collective. Through the method, so a legacy tensor keeps its spec too."""
    return st.reshard(spec)


def reshard_method(st: ShardedTensor, spec: ShardingSpec) -> ShardedTensor:
    """`ShardedTensor.reshard` (a legacy tensor's adds its spec)."""
    reshard_in_place(st, spec)
    return st


def reshard_in_place(st: ShardedTensor, spec: ShardingSpec) -> None:
    """Move `st`'s data to the layout of `spec` and make that `st`'s layout.

    Refused for a tensor inside an autograd graph (its gradient would arrive in
    the old layout); a leaf, a parameter included, may change layout."""
    if st.grad_fn is not None:
        raise InvalidArgumentError(
            f"reshard changes a tensor in place; this one (shape {tuple(st.shape)}) is the "
            f"result of {type(st.grad_fn).__name__} in an autograd graph: use "
            f"redistribute(layout), which returns a new tensor"
        )
    world = st.layout_spec.world_size
    layout = spec_layout(spec, tuple(st.shape), world, st.group)
    if layout == st.layout_spec:
        return
    with torch.no_grad():  # the data moves; `st` stays the leaf it was
        moved = st.redistribute(layout)
    if st.requires_grad:  # the new shards are leaves, flagged as the old ones were
        for shard in moved._shards:
            shard.requires_grad_(True)
    st._layout, st._shards = moved._layout, moved._shards
    st._mesh_offsets = st._placements = None


def gather_into(st: ShardedTensor, dst: int = 0, out: torch.Tensor | None = None) -> Any:
    """Legacy `gather`: the whole tensor on `dst`, copied into `out` when given
    (then returned). Collective; a bad `out` is refused after it, on its rank."""
    full = st.gather(dst)
    if out is None:
        return full
    if full is None:
        raise InvalidArgumentError(
            f"rank {st.rank}: gather(dst={dst}, out=...) takes `out` only on rank {dst}"
        )
    if tuple(out.shape) != tuple(full.shape):
        raise ShardMismatchError(
            f"rank {st.rank}: gather out= has shape {tuple(out.shape)} but the tensor is "
            f"{tuple(full.shape)}"
        )
    with torch.no_grad():
        out.copy_(full)
    return out
